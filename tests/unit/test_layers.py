"""The import-direction table of ARCHITECTURE.md, checked by parsing every module's imports."""

import ast
from pathlib import Path

import loom

ROOT = Path(loom.__file__).parent
LAYER = {
    "compat": 0,
    "config": 0,
    "device": 0,
    "env": 0,
    "log": 0,
    "errors": 0,
    "faults": 0,
    "outputs": 0,
    "paths": 0,
    "data": 1,
    "model": 1,
    "metrics": 1,
    "launch": 1,
    "plot": 1,
    "distributed": 2,
    "parallel": 3,
    "optim": 3,
    "checkpoint": 4,
    "checkpoint_tools": 4,
    "eval": 4,
    "generate": 4,
    "runs": 4,
    "export": 5,
    "export_gguf": 5,
    "serve": 5,
    "chat": 4,
    "engine": 4,
    "rl": 4,
    "train": 5,
    "plan": 5,
    "doctor": 5,
    "dryrun": 5,
    "cli": 6,
    "bench": 6,
    "verify": 6,
    "__main__": 6,
    "__init__": 0,
}


def _top(module: str) -> str:
    return module.split(".")[1] if module.startswith("loom.") else ""


def test_every_import_points_down_the_layers():
    bad = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        name = rel.parts[0].removesuffix(".py")
        assert name in LAYER, f"{rel}: add its package to the layer table"
        for node in ast.walk(ast.parse(path.read_text())):
            mods = []
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module == "loom" and node.level == 0:
                # from loom import checkpoint, log (a module each); __version__ is loom/__init__.py's
                mods = [
                    f"loom.{a.name}"
                    if (ROOT / a.name).is_dir() or (ROOT / f"{a.name}.py").is_file()
                    else "loom.__init__"
                    for a in node.names
                ]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                mods = [node.module]
            for m in mods:
                target = _top(m)
                if m.startswith("loom.") and target != name and LAYER[target] > LAYER[name]:
                    bad.append(f"{rel} imports {m}")
                # the model stays single-device; its parallel plan (model/*_parallel.py) names torch's styles
                plan_file = rel.name.endswith("_parallel.py")
                if name == "model" and (
                    (m.startswith("torch.distributed") and not plan_file) or target == "parallel"
                ):
                    bad.append(f"{rel}: the model must stay single-device ({m})")
                if name == "launch" and m.split(".")[0] == "torch":
                    bad.append(f"{rel}: launch never imports torch")
    assert not bad, bad


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_import_cycle():
    """No module reaches itself through loom imports, at any depth (function-level imports included: a lazy
    import cycle still ties two modules that should not know each other, as cli <-> verify once did)."""
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.ImportFrom)
                and node.level == 0
                and (node.module or "").startswith("loom")
            ):
                deps |= {
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                    for a in node.names
                }
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("loom")}
        graph[name] = {d for d in deps if d in modules and d != name}
    cycles, done = [], set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            cycles.append(path[path.index(node) :] + [node])
            return
        if node in done:
            return
        for dep in sorted(graph[node]):
            visit(dep, [*path, node])
        done.add(node)

    for name in sorted(graph):
        visit(name, [])
    assert not cycles, [" -> ".join(c) for c in cycles]


def test_train_functions_fit_a_screen():
    """The training package reads in small pieces: no function of loom/train/ is longer than 60 lines."""
    long = []
    for path in (ROOT / "train").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                and node.end_lineno - node.lineno >= 60
            ):
                long.append(
                    f"{path.name}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
                )
    assert not long, long


def test_no_two_parts_import_each_other():
    """Each folder or top-level module of loom (a part, as in the layer table) is one node: no part reaches itself
    through another, at any depth. Two parts of one layer may use each other in one direction only (eval ->
    engine: the harness generates through loom.engine), so within a layer too every arrow points one way."""
    graph: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        name = path.relative_to(ROOT).parts[0].removesuffix(".py")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module == "loom" and node.level == 0:
                mods = [f"loom.{a.name}" for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                mods = [node.module]
            else:
                continue
            targets = {_top(m) for m in mods if m.startswith("loom.")}
            graph.setdefault(name, set()).update(t for t in targets if t in LAYER and t != name)
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            cycles.append(" -> ".join(path[path.index(node) :] + [node]))
            return
        for dep in sorted(graph.get(node, ())):
            visit(dep, [*path, node])

    for name in sorted(graph):
        visit(name, [])
    assert not cycles, sorted(set(cycles))
