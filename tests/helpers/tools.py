"""The command-line scripts of tools/ loaded as modules, so a test or fixture calls their
``main(argv)`` in this process (tools/ is not a package)."""
from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from tests.helpers.env import REPO


def load_tool(name: str, module_name: str | None = None) -> ModuleType:
    """``tools/<name>.py`` as the module ``module_name`` (default ``name``; registered in
    ``sys.modules``: the tools' dataclasses look their module up there); loaded once."""
    module_name = module_name or name
    path = str(REPO / "tools" / f"{name}.py")
    if getattr(sys.modules.get(module_name), "__file__", None) == path:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module
