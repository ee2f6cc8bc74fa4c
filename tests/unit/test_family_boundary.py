"""A family is a folder (issue 44): outside src/loom/model/ nothing branches on a family's name, and nothing
probes a model with hasattr/getattr for a hook a family may or may not have: every hook is declared, with its
default, on loom.model.registry.ModelSpec (or the FamilyModel protocol). Compared against: the source itself,
parsed with ast."""

from __future__ import annotations

import ast
from pathlib import Path

import loom

ROOT = Path(loom.__file__).parent
FAMILY_NAMES = {"gpt2", "llama", "moe"}  # the built-in families (loom.model.registry.names())
# what a model, its parts and its plan are called outside model/: probing them is what the spec replaced
MODEL_LIKE = {"model", "self.model", "model.cfg", "self.model.cfg", "mcfg", "model_cfg", "plan", "self.plan"}
MODEL_LIKE |= {"block.attn", "attn", "scorer.model", "self.scorer.model"}


def _outside_model():
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] != "model":
            yield rel, ast.parse(path.read_text(encoding="utf-8"))


def _strings(node: ast.AST) -> set[str]:
    return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def test_no_family_name_is_branched_on_outside_model():
    """No comparison with a family's name (`family == "moe"`, `in ("llama", ...)`), and no family looked up
    by its name (`get("moe")`): the code asks the family's spec instead."""
    bad = []
    for rel, tree in _outside_model():
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                # model.family or a spec's name against a string: a family chosen by its name
                about = [s for s in sides if ast.unparse(s).endswith((".family", "spec.name"))]
                if about and any(_strings(s) for s in sides if s not in about):
                    bad.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
            elif isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] in ("get", "spec_of"):
                if any(isinstance(a, ast.Constant) and a.value in FAMILY_NAMES for a in node.args):
                    bad.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
            elif isinstance(node, ast.Dict):  # {"family": "moe", ...}: choosing a family by name
                for k, v in zip(node.keys, node.values, strict=True):
                    if isinstance(k, ast.Constant) and k.value == "family" and isinstance(v, ast.Constant):
                        bad.append(f"{rel}:{node.lineno}: {ast.unparse(node)[:80]}")
    assert not bad, "branch on a ModelSpec hook instead:\n" + "\n".join(bad)


def test_no_model_is_probed_with_hasattr_outside_model():
    """hasattr(model, ...) / getattr(model, ..., default): a hook found by duck typing is declared on
    ModelSpec (with its default) and called through the spec."""
    bad = []
    for rel, tree in _outside_model():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args):
                continue
            probe = node.func.id == "hasattr" or (node.func.id == "getattr" and len(node.args) == 3)
            if probe and ast.unparse(node.args[0]) in MODEL_LIKE:
                bad.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    assert not bad, "declare the hook on ModelSpec:\n" + "\n".join(bad)


def test_parallel_imports_no_family():
    """loom.parallel applies a family's plan from outside: it imports the registry and shared model code
    (lora, vocab), never a family's folder (parallel/fp8 had imported the GPT for its padding mask)."""
    bad = []
    for path in sorted((ROOT / "parallel").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                mods = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            bad += [f"{path.name}: {m}" for m in mods if m.startswith(("loom.model.gpt", "loom.model.moe"))]
    assert not bad, bad
