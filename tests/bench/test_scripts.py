"""Every script in bench/ stays runnable, checked cheaply (no benchmark runs here; each has ``--quick`` for that).

- Every user-facing bench (``bench/*.py`` not starting with ``_``; those are helpers the benches start or
  import) declares a ``--quick`` flag and runs ``main()`` under ``if __name__ == "__main__"``.
- Every ``from plait... import name`` in any bench file, at module level or inside a function, names a module
  and an attribute that exist: the library moving under a bench (a renamed function, a removed classmethod
  imported by name) fails here in a second instead of at the end of a long run.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
SCRIPTS = sorted(p for p in BENCH.glob("*.py") if not p.name.startswith("_"))
ALL = sorted(BENCH.glob("*.py"))


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _adds_quick_flag(tree: ast.Module) -> bool:
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "add_argument"
               and any(isinstance(a, ast.Constant) and a.value == "--quick" for a in n.args)
               for n in ast.walk(tree))


def _has_main_guard(tree: ast.Module) -> bool:
    return any(isinstance(n, ast.If) and "__main__" in ast.unparse(n.test) for n in tree.body)


def test_the_bench_folder_has_benches_and_helpers() -> None:
    names = {p.stem for p in SCRIPTS}
    assert {"api", "compress", "dp", "ps", "comm_layer"} <= names, names
    assert {"_common", "_ttq", "_ddp_peer"} <= {p.stem for p in ALL}


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_every_bench_has_a_quick_mode_and_a_main_guard(path: Path) -> None:
    tree = _tree(path)
    assert _adds_quick_flag(tree), f"{path.name}: add a --quick flag (the smallest run of every code path)"
    assert _has_main_guard(tree), f"{path.name}: no `if __name__ == '__main__':`"


def _plait_imports(tree: ast.Module) -> list[tuple[str, str, int]]:
    return [(n.module, a.name, n.lineno) for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom) and n.level == 0 and n.module and n.module.split(".")[0] == "plait"
            for a in n.names]


def test_every_plait_name_a_bench_imports_exists() -> None:
    missing = []
    for path in ALL:
        for module, name, line in _plait_imports(_tree(path)):
            try:
                if not hasattr(importlib.import_module(module), name):
                    importlib.import_module(f"{module}.{name}")  # a submodule imported by name
            except ModuleNotFoundError:
                missing.append(f"{path.name}:{line}: from {module} import {name}")
    assert not missing, missing
