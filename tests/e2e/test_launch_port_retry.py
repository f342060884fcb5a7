"""tests/helpers/launcher.launch (and launch_together) when the port it found free is taken
before rank 0 listens (another pytest-xdist worker's process took it): the run refused for that
alone, in its one line (rtd_scale/distributed.py), is launched again on another port and
trains."""
from __future__ import annotations

import contextlib
import socket

import pytest

from tests.helpers import launcher
from tests.helpers.env import free_port
from tests.helpers.launcher import common, launch, launch_together, scalars

pytestmark = pytest.mark.e2e


@contextlib.contextmanager
def first_port_taken(monkeypatch):
    """``launcher.free_port`` gives, first, a port a listener holds for the block, then free
    ones; yields (the held port, every port drawn)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken, drawn = held.getsockname()[1], []

        def ports():
            drawn.append(taken if not drawn else free_port())
            return drawn[-1]

        monkeypatch.setattr(launcher, "free_port", ports)
        yield taken, drawn


def test_a_port_taken_before_rank_0_listens_is_retried_on_another(wiki_shards, tmp_path,
                                                                 monkeypatch):
    with first_port_taken(monkeypatch) as (taken, drawn):
        r = launch(common(wiki_shards, tmp_path / "run", 1, ["--eval-iters", "0"],
                          save_interval=None), ranks=1)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert len(drawn) == 2 and drawn[0] == taken and drawn[1] != taken
    assert sorted(scalars(str(tmp_path / "run" / "tensorboard"))["loss/mlm"]) == [1]


def test_launch_together_retries_only_the_run_whose_port_was_taken(wiki_shards, tmp_path,
                                                                 monkeypatch):
    """The same for runs launched side by side: the one refused is launched again (CI lost a
    module of tests/e2e/test_resume_changes.py to a port taken between the draw and listen)."""
    with first_port_taken(monkeypatch) as (taken, drawn):
        jobs = [common(wiki_shards, tmp_path / name, 1, ["--eval-iters", "0"], save_interval=None)
                for name in ("a", "b")]
        results = launch_together(jobs)
    assert [r.returncode for r in results] == [0, 0], results[0].stderr[-3000:]
    assert len(drawn) == 3 and drawn[0] == taken and taken not in drawn[1:]
    assert "--master_port" in results[0].args and str(taken) not in results[0].args
    for name in ("a", "b"):
        assert sorted(scalars(str(tmp_path / name / "tensorboard"))["loss/mlm"]) == [1]


def test_the_refusal_is_what_the_retry_looks_for(wiki_shards, tmp_path):
    """The control: on a port held for the whole launch, and the launcher told that port
    (--master_port in launcher_args: the caller's own choice, never retried), the run is
    refused in the line PORT_TAKEN matches."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        r = launch(common(wiki_shards, tmp_path / "run", 1, ["--eval-iters", "0"],
                          save_interval=None), ranks=1,
                   launcher_args=("--master_port", str(taken)))
    assert r.returncode == 1
    assert launcher.PORT_TAKEN.search(r.stderr), r.stderr[-3000:]
    assert f"error: MASTER_PORT {taken} is already in use on 127.0.0.1" in r.stderr
