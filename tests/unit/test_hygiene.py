"""The house rules that a reviewer would otherwise have to remember, checked by reading the source (no import
of the code under test, no process): no formatter escape, no long function in src/, no private torch name
outside loom.compat. Compared against: the rules in STYLE.md and issue 44 ("hygiene, kept by tests")."""

import ast
import re
from pathlib import Path

import loom

SRC = Path(loom.__file__).parent
TOP = SRC.parents[1]
MAX_LINES = 80

# qualified name (module.function or module.Class.method) -> why it may stay longer than MAX_LINES, for now.
# An entry that no longer names a long function fails the test: delete it when the function is split.
LONG_FUNCTIONS: dict[str, str] = {}  # none today


def _functions(tree: ast.AST, prefix: str):
    """(qualified name, node) of every function, nested ones included, under their class or function."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = f"{prefix}.{node.name}"
            if not isinstance(node, ast.ClassDef):
                yield name, node
            yield from _functions(node, name)
        else:
            yield from _functions(node, prefix)


def _module(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources(*folders: Path):
    for folder in folders:
        yield from sorted(folder.rglob("*.py"))


def test_no_formatter_escapes():
    """The house style has no formatter escape: the whole tree is as `ruff format` writes it."""
    marker = "# fmt: " + "skip"
    found = [
        f"{p.relative_to(TOP)}:{i}"
        for p in _sources(TOP / "src", TOP / "tests", TOP / "benchmarks")
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if marker in line
    ]
    assert not found, found


def test_no_function_over_80_lines():
    """Every function of src/loom fits in MAX_LINES lines, from its `def` to its last line (docstring and
    comments included), but for the exceptions listed in LONG_FUNCTIONS with their reason."""
    long = {}
    for path in _sources(SRC):
        for name, node in _functions(ast.parse(path.read_text(encoding="utf-8")), _module(path)):
            if node.end_lineno - node.lineno + 1 > MAX_LINES:
                long[name] = (
                    f"{path.relative_to(SRC.parent)}:{node.lineno} ({node.end_lineno - node.lineno + 1})"
                )
    new = {n: at for n, at in long.items() if n not in LONG_FUNCTIONS}
    assert not new, f"split these into named steps (or list them with a reason): {new}"
    stale = sorted(set(LONG_FUNCTIONS) - set(long))
    assert not stale, f"no longer long (or gone): delete from LONG_FUNCTIONS: {stale}"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _compat_names() -> set[str]:
    """The private names of torch that loom.compat reaches: every `x._name` and "_name" string it uses that is
    not one of its own definitions."""
    tree = ast.parse((SRC / "compat.py").read_text(encoding="utf-8"))
    own = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    own |= {
        t.id
        for n in ast.walk(tree)
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Name)
    }
    used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    used |= {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    return {n for n in used if _private(n) and n.isidentifier()} - own


def _torch_names(tree: ast.AST) -> set[str]:
    """Names a module binds by importing torch or something from it (torch, nn, F, dist, DTensor, ...)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {
                (a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] == "torch"
            }
        elif (
            isinstance(node, ast.ImportFrom)
            and (node.module or "").split(".")[0] == "torch"
            and not node.level
        ):
            names |= {a.asname or a.name for a in node.names}
    return names


def _root(node: ast.AST) -> ast.AST:
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.value if not isinstance(node, ast.Call) else node.func
    return node


def private_torch_uses(path: Path, known: set[str]) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    torch_names, found = _torch_names(tree), []
    for node in ast.walk(tree):
        what = None
        if isinstance(node, ast.Import):
            what = next(
                (a.name for a in node.names if a.name.startswith("torch") and _private_path(a.name)), None
            )
        elif (
            isinstance(node, ast.ImportFrom)
            and (node.module or "").split(".")[0] == "torch"
            and not node.level
        ):
            names = [node.module, *(a.name for a in node.names)]
            what = node.module if any(_private_path(n) for n in names) else None
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            root = _root(node.value)
            on_torch = isinstance(root, ast.Name) and root.id in torch_names
            on_super = isinstance(root, ast.Name) and root.id == "super"
            what = f".{node.attr}" if on_torch or on_super or node.attr in known else None
        elif isinstance(node, ast.Constant) and node.value in known:
            what = repr(node.value)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in known:
            what = f"def {node.name} (an override of torch's)"
        if what:
            found.append(f"{path.relative_to(SRC.parent)}:{node.lineno} {what}")
    return found


def _private_path(dotted: str) -> bool:
    return any(_private(part) for part in dotted.split("."))


# files other helpers of issue 44 are rewriting: the one private use each keeps until they call loom.compat
PRIVATE_EXCEPTIONS: dict[str, str] = {}


def test_private_torch_names_only_in_compat():
    """torch's private names (a single leading underscore) are used in loom/compat.py only, each documented
    there with the torch versions it was checked on (tests/unit/test_compat.py resolves them).

    The rule, as read from each module's syntax tree outside compat.py:
      * no import of a torch module whose dotted path or imported name has a part starting with `_`
        (`torch._subclasses`, `from torch.distributed.pipelining import _utils`);
      * no `x._name` where x is bound by a torch import (`torch._foreach_add_`, `nn.Module._apply`) or is
        `super()` (a subclass calling into torch's private methods);
      * none of the private names compat.py itself reaches (read from compat.py: `_local_tensor`,
        `_parameters`, `_stages`, ...) as an attribute, a string (`getattr(t, "_local_tensor")`), or a method
        defined to override torch's.
    loom's own private names (`self._x`, `module._helper`) are not torch's and stay allowed; so are other
    libraries' (lm-eval's, torchao's), which this test cannot tell apart from loom's and does not try to."""
    known = _compat_names()
    found = [
        use
        for path in _sources(SRC)
        if path.name != "compat.py" and str(path.relative_to(SRC.parent)) not in PRIVATE_EXCEPTIONS
        for use in private_torch_uses(path, known)
    ]
    assert not found, f"move each into loom/compat.py (with the torch versions it was checked on): {found}"


# qualified name -> why it stays although nothing in src/, benchmarks/ or scripts/ names it
CALLED_FROM_OUTSIDE = {
    "loom.checkpoint_tools._Window.readable": "io's protocol (io.BufferedReader asks it)",
    "loom.checkpoint_tools._Window.seekable": "io's protocol (io.BufferedReader asks it)",
    "loom.checkpoint_tools._Rebuild.persistent_load": "pickle's protocol (torch.load's persistent ids)",
    **{
        f"loom.eval.lm_adapter.LoomLM.{m}": "lm-eval's LM interface"
        for m in ("tokenizer_name", "loglikelihood_rolling", "generate_until")
    },
    "loom.compat._StepMixin._update_peak_stats": "an override torch's MemTracker calls",
}


# a string that is a name (getattr's, a registry's) or an entry point's 'module:function'
NAME = re.compile(r"[A-Za-z_][\w.]*(:\w+)?")
ENTRY_POINT = re.compile(r"[\w.]+:(\w+)")


def _named_anywhere() -> set[str]:
    """Every name the code uses: variables, attributes, imported names, and strings that are a name; prose
    (docstrings, messages) does not count."""
    used = set()
    for path in _sources(SRC, TOP / "benchmarks", TOP / "scripts"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Name):
                used.add(node.id)
            elif isinstance(node, ast.Attribute):
                used.add(node.attr)
            elif isinstance(node, ast.alias):
                used.add(node.name.split(".")[-1])
            elif (
                isinstance(node, ast.Constant) and isinstance(node.value, str) and NAME.fullmatch(node.value)
            ):
                used.add(node.value.rsplit(":", 1)[-1].rsplit(".", 1)[-1])
    used.update(ENTRY_POINT.findall((TOP / "pyproject.toml").read_text(encoding="utf-8")))
    return used


def test_no_code_only_tests_call():
    """Every top-level function and class of src/loom, and every method of a top-level class, is named
    somewhere in src/, benchmarks/, scripts/ or pyproject.toml (its own definition aside): code that only tests
    call is deleted, or moved into tests/ when it is a test's oracle. Methods another library calls by
    protocol are listed in CALLED_FROM_OUTSIDE with the reason."""
    used = _named_anywhere()
    unused = []
    for path in _sources(SRC):
        module = _module(path)
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            defs = [(f"{module}.{node.name}", node.name)]
            if isinstance(node, ast.ClassDef):
                defs += [
                    (f"{module}.{node.name}.{m.name}", m.name)
                    for m in node.body
                    if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) and not m.name.startswith("__")
                ]
            unused += [q for q, name in defs if name not in used and q not in CALLED_FROM_OUTSIDE]
    assert not unused, (
        f"nothing but tests (if anything) calls these: delete them or move them to tests/: {unused}"
    )
    stale = [q for q in CALLED_FROM_OUTSIDE if q.rsplit(".", 1)[-1] in used]
    assert not stale, f"now named in the code: delete from CALLED_FROM_OUTSIDE: {stale}"
