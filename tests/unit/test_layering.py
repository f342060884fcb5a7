"""The import rules of DESIGN.md §2, read from the source (every import, at module level or inside a
function): ``objectives/``, ``data/`` and the config (``config.py``, ``presets.py``, ``batch.py``)
never import ``model/`` or ``training/``; ``model/`` never imports ``training/`` or ``hf/``;
``training/`` never imports ``hf/``; ``objectives/``, ``data/`` and the config never import
deepspeed, and only ``data/shards.py``
of them knows megatron-core (its ``.bin/.idx`` indexed dataset is the shard format). Nothing in
the package imports the test oracles (``verify/``) or the tests."""
from __future__ import annotations

import ast

import pytest

from tests.helpers.env import REPO

PKG = REPO / "rtd_scale"

# (files, packages they must never import)
RULES = [
    ("objectives", ("rtd_scale.model", "rtd_scale.training", "rtd_scale.hf", "deepspeed",
                    "megatron")),
    ("data", ("rtd_scale.model", "rtd_scale.training", "rtd_scale.hf", "deepspeed",
              "megatron.core.models", "megatron.core.transformer", "megatron.core.parallel_state",
              "megatron.core.tensor_parallel")),
    *((f, ("rtd_scale.model", "rtd_scale.training", "rtd_scale.hf", "deepspeed", "megatron"))
      for f in ("config.py", "presets.py", "batch.py")),
    ("model", ("rtd_scale.training", "rtd_scale.hf")),
    ("training", ("rtd_scale.hf",)),
    ("", ("verify", "tests")),  # the whole package
]


def imports_of(path, package: str | None = None) -> set[str]:
    """Every module ``path`` imports, relative imports resolved against its package (by default
    the one its place in the repository gives)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    if package is None:
        package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.add(mod)
            found.update(f"{mod}.{a.name}" for a in node.names)
    return found


def files_of(where: str):
    p = PKG / where
    return [p] if p.suffix == ".py" else sorted(p.rglob("*.py"))


@pytest.mark.parametrize("where,forbidden", RULES, ids=[r[0] or "rtd_scale" for r in RULES])
def test_imports_flow_one_way(where, forbidden):
    files = files_of(where)
    assert files, where
    bad = [f"{f.relative_to(REPO)} imports {m}" for f in files for m in sorted(imports_of(f))
           if any(m == b or m.startswith(b + ".") for b in forbidden)]
    assert not bad, bad


def test_the_rule_reader_sees_a_forbidden_import(tmp_path):
    """Negative control: the reader finds a function-level and a relative import."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from ..training import loop\n    import deepspeed\n")
    found = imports_of(probe, package="rtd_scale.model")
    assert {"rtd_scale.training", "rtd_scale.training.loop", "deepspeed"} <= found, found


def _package_modules() -> dict[str, object]:
    mods = {}
    for f in PKG.rglob("*.py"):
        name = ".".join(f.relative_to(REPO).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = f
    return mods


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``graph`` (module → modules it imports): its strongly connected
    components of more than one module, each sorted (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, cycles = {}, {}, set(), [], []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, todo = work[-1]
            nxt = next((m for m in todo if m in graph), None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    component.append(m)
                    if m == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return sorted(cycles)


def test_no_import_cycle():
    """No rtd_scale modules import each other, directly or through others, at module level or
    inside a function (the optimizer lives in training/optimizer.py, so training/engine.py and
    training/lr_schedule.py read it without reading each other)."""
    mods = _package_modules()
    imports = {m: {x for x in imports_of(f) if x in mods and x != m} for m, f in mods.items()}
    assert "rtd_scale.training.optimizer" in imports["rtd_scale.training.lr_schedule"]
    cycles = import_cycles(imports)
    assert not cycles, cycles


def test_the_cycle_finder_sees_longer_cycles():
    """Negative control: a 3-cycle and a 2-cycle beside an acyclic chain, each found whole."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": set(),
             "x": {"y", "e"}, "y": {"x"}, "z": {"a"}}
    assert import_cycles(graph) == [["a", "b", "c"], ["x", "y"]]
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
