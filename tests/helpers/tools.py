"""The command-line scripts of tools/ loaded as modules, so a test or fixture calls their
``main(argv)`` in this process (tools/ is not a package)."""
from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from tests.helpers.env import REPO


def load_tool(name: str) -> ModuleType:
    """``tools/<name>.py`` as the module ``name`` (registered in ``sys.modules``: the tools'
    dataclasses look their module up there); loaded once."""
    if name in sys.modules and getattr(sys.modules[name], "__file__", None) == str(REPO / "tools" / f"{name}.py"):
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
