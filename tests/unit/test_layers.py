"""The import-direction table of ARCHITECTURE.md, checked by parsing every module's imports."""

import ast
from pathlib import Path

import loom

ROOT = Path(loom.__file__).parent
LAYER = {
    "config": 0, "env": 0, "log": 0, "errors": 0, "faults": 0, "outputs": 0, "paths": 0,
    "data": 1, "model": 1, "metrics": 1, "launch": 1, "plot": 1,
    "distributed": 2,
    "parallel": 3, "optim": 3,
    "checkpoint": 4, "checkpoint_tools": 4, "eval": 4, "generate": 4,
    "train": 5, "plan": 5, "doctor": 5,
    "cli": 6, "bench": 6, "verify": 6, "__main__": 6, "__init__": 0,
}  # fmt: skip


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
