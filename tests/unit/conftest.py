"""tests/unit/ is single-process (STYLE rule 11): the set-up, call and teardown of every test
here, the session fixtures it is first to request included (``wiki_shards``), run under the guard
of tests/helpers/no_processes.py, so a test that starts a process fails with the rule's message."""
from __future__ import annotations

import pytest

from tests.helpers.no_processes import guarded


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    with guarded():
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with guarded():
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    with guarded():
        return (yield)
