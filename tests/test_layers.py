"""plait's layers have no circles and no upward edges, counting imports inside functions too.

Every module of ``src/plait`` belongs to one layer (``LAYERS``, bottom first, as docs/architecture.md
draws them); a module may import modules of its own layer or of the layers below, never above, and the
imports between modules form no cycle. Every ``import`` statement is read from the source (module level,
inside functions, under ``TYPE_CHECKING``), so an import hidden in a function to dodge a circle is a
circle here too.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
ARCHITECTURE = SRC.parent / "docs" / "architecture.md"

# Bottom first. A module belongs to the first layer with a prefix that matches its dotted name (longest
# prefix wins within a layer list; the package ``plait`` itself is the public API at the top).
PLAN_MODEL = ("buckets", "derive", "flops", "hardware", "kernels", "layouts", "memory", "nccl", "network", "opcore",
              "ops", "ops_float8", "ops_moe", "params", "planner", "rank_memory", "schedule", "shapes", "simulate",
              "stages", "timeline", "trace", "wire", "workload")
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("runtime", ("plait.runtime", "plait.config", "plait.config_sections", "plait.config_layout", "plait.topology")),
    # the pure cost and memory model: above the runtime (it reads a Config's sections and raises ConfigError)
    ("plan/model", tuple(f"plait.plan.{m}" for m in PLAN_MODEL)),
    ("components", ("plait.components", "plait.checkpoint")),
    ("data observe", ("plait.data", "plait.observe")),
    ("comm fault nn", ("plait.comm", "plait.fault", "plait.nn", "plait.models")),
    # a model's folder: the model itself with the layers above (plait.models); what adapts it to each dimension
    # and its spec, which registers them, with the strategies
    ("strategies", ("plait.parallel", "plait.ps", "plait.validate", "plait.checkpoint.weights",
                    "plait.checkpoint.layout_state",
                    *(f"plait.models.gpt.{m}" for m in ("parallelize", "pipeline", "context", "spec")))),
    ("engine", ("plait.engine", "plait.checkpoint.checkpointer", "plait.checkpoint.export")),
    ("trainer", ("plait.train",)),
    ("calibrate", ("plait.plan",)),
    ("recipes", ("plait.recipes",)),
    ("cli", ("plait.cli", "plait.plan.commands", "plait.launch_files", "plait.launch", "plait.__main__", "plait")),
]


def modules() -> dict[str, Path]:
    out = {}
    for f in SRC.rglob("*.py"):
        parts = list(f.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def layer_of(module: str) -> int:
    best, best_len = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    assert best is not None, f"{module} belongs to no layer: add it to LAYERS"
    return best


def imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the plait modules it imports (a ``from package import name`` of a submodule counts as that
    submodule)."""

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {t for a in node.names if a.name.startswith("plait") and (t := resolve(a.name))}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                if not base.startswith("plait"):
                    continue
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    target = sub if sub in mods else resolve(base)
                    if target:
                        found.add(target)
        found.discard(mod)
        edges[mod] = found
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles() -> None:
    found = cycles(imports(modules()))
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_no_upward_imports() -> None:
    edges = imports(modules())
    upward = sorted(f"{a} ({LAYERS[layer_of(a)][0]}) imports {b} ({LAYERS[layer_of(b)][0]})"
                    for a, targets in edges.items() for b in targets if layer_of(b) > layer_of(a))
    assert not upward, f"{len(upward)} upward imports:\n" + "\n".join(upward)


def test_the_checker_sees_hidden_circles_and_upward_edges(tmp_path: Path) -> None:
    """The rules can fail: an import inside a function closes a circle, and a low layer reaching up is named."""
    mods = {"plait.a": tmp_path / "a.py", "plait.b": tmp_path / "b.py"}
    mods["plait.a"].write_text("import plait.b\n")
    mods["plait.b"].write_text("def f():\n    from plait import a\n")
    edges = imports(mods)
    assert cycles(edges) == [["plait.a", "plait.b"]]
    assert layer_of("plait.config") < layer_of("plait.engine") < layer_of("plait.cli")


def test_the_architecture_page_lists_the_tree() -> None:
    """docs/architecture.md names every package and top-level module of ``src/plait``, every module of ``plan/`` and
    of ``parallel/``'s top level (each in backticks), and every module its ``parallel/`` paragraph names exists."""
    text = ARCHITECTURE.read_text()
    named = {n.rstrip("/").rpartition("/")[2] for n in re.findall(r"`([A-Za-z0-9_/]+)`", text)}
    plait = SRC / "plait"
    wanted = {f.stem for f in plait.glob("*.py")} | {d.name for d in plait.iterdir() if (d / "__init__.py").exists()}
    wanted |= {f.stem for f in (plait / "plan").glob("*.py")} | {f.stem for f in (plait / "parallel").glob("*.py")}
    wanted -= {"__init__", "__main__"}
    assert not wanted - named, f"docs/architecture.md does not name: {sorted(wanted - named)}"
    paragraph = text[text.index("`src/plait/parallel/` holds"):]
    paragraph = paragraph[:paragraph.index("\n\n")]
    parallel = plait / "parallel"
    listed = {n for n in re.findall(r"`([a-z0-9_]+)`", paragraph)}
    missing = {n for n in listed if not (parallel / f"{n}.py").exists() and not (parallel / n).is_dir()}
    assert not missing, f"docs/architecture.md's parallel/ paragraph names modules that do not exist: {sorted(missing)}"
