"""The shape of analyses/: its modules import each other without a cycle, and none keeps state at
module level (what an analysis derives lives on the Context: `ctx.memo`); the trainer's package
(tracekit/dlrm) has no import cycle either.

Both read the source with `ast`, so they cover imports inside functions and under `if
TYPE_CHECKING:` too (a guard that hides a cycle is still a cycle)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "analyses"
MUTABLE_CALLS = {"dict", "list", "set", "bytearray", "defaultdict", "OrderedDict", "Counter", "deque", "ChainMap"}
"""Constructors of mutable containers: at module level only as an UPPER_CASE constant never mutated."""
CACHE_CALLS = {"WeakKeyDictionary", "WeakValueDictionary", "WeakSet", "lru_cache", "cache"}
"""Caches, never at module level (nor as decorators of module-level functions)."""
MUTATING_METHODS = {"append", "extend", "insert", "add", "update", "setdefault", "pop", "popitem", "clear",
                    "remove", "discard", "sort", "reverse", "appendleft", "extendleft"}


def modules(package: str = PACKAGE) -> dict[str, ast.Module]:
    """{dotted module name: its parsed source} for every file under `package` (a folder of the repo)."""
    out = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = ast.parse(path.read_text(), filename=str(path))
    return out


def imported(name: str, tree: ast.Module, known: set[str]) -> set[str]:
    """The modules of `known` that module `name` imports anywhere in its source."""
    package = name if name in known and any(k.startswith(name + ".") for k in known) else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import analyses.x.y` also imports analyses.x
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` as the modules along it (first = last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_analyses_import_each_other_without_a_cycle() -> None:
    trees = modules()
    graph = {name: imported(name, tree, set(trees)) for name, tree in trees.items()}
    assert graph["analyses.exchange"] >= {"analyses.attribution", "analyses.network"}  # the parse sees imports
    found = cycle(graph)
    assert found is None, "import cycle: " + " -> ".join(found)


def test_the_trainers_modules_import_each_other_without_a_cycle() -> None:
    """tracekit/dlrm: the sharded embeddings name tier 2 by the protocol they call (sharding.Tier), not
    by its class, which builds on them."""
    trees = modules("tracekit/dlrm")
    graph = {name: imported(name, tree, set(trees)) for name, tree in trees.items()}
    assert "tracekit.dlrm.sharding" in graph["tracekit.dlrm.node_tier"]  # the parse sees imports
    found = cycle(graph)
    assert found is None, "import cycle: " + " -> ".join(found)


def test_the_cycle_check_sees_a_cycle_hidden_in_a_function() -> None:
    trees = {"p": ast.parse(""), "p.a": ast.parse("from p import b"),
             "p.b": ast.parse("def f():\n    from p.a import x")}
    graph = {name: imported(name, tree, set(trees)) for name, tree in trees.items()}
    assert cycle(graph) == ["p.a", "p.b", "p.a"]


def _name(node: ast.expr) -> str | None:
    """The called name of `dict()`, `weakref.WeakKeyDictionary()`, `functools.lru_cache(...)`."""
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _mutable(value: ast.expr) -> bool:
    return (isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp))
            or (isinstance(value, ast.Call) and _name(value) in MUTABLE_CALLS | CACHE_CALLS))


def _constant(name: str) -> bool:
    return name.lstrip("_").isupper()


def module_state(trees: dict[str, ast.Module]) -> list[str]:
    """Module-level mutable state in `trees`: caches anywhere at module level, mutable containers
    bound to a name that is not an UPPER_CASE constant, and constants some module mutates."""
    problems, constants = [], set()
    for module, tree in trees.items():
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                problems += [f"{module}.{node.name}: decorated with a cache" for d in node.decorator_list
                             if _name(d) in CACHE_CALLS]
                continue
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                targets, value = [node.target], node.value
            else:
                continue
            names = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
            if isinstance(value, ast.Call) and _name(value) in CACHE_CALLS:
                problems += [f"{module}.{n}: a module-level cache" for n in names]
            elif _mutable(value):
                problems += [f"{module}.{n}: mutable module-level state" for n in names if not _constant(n)]
                constants.update(n for n in names if _constant(n))
    for module, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
                stores = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
                hit = [_name(t.value) for t in stores if isinstance(t, ast.Subscript)]
                hit += [t.id for t in stores if isinstance(node, ast.AugAssign) and isinstance(t, ast.Name)]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                hit = [_name(node.func.value)] if node.func.attr in MUTATING_METHODS else []
            else:
                continue
            problems += [f"{module}:{node.lineno}: mutates the constant {n}" for n in hit if n in constants]
    return problems


def test_no_analysis_keeps_state_at_module_level() -> None:
    problems = module_state(modules())
    assert not problems, "\n".join(problems)


def test_the_state_check_sees_a_cache_and_a_mutated_constant() -> None:
    tree = ast.parse("import weakref\n_cache = weakref.WeakKeyDictionary()\nseen = {}\nTABLES = {}\n"
                     "KINDS = ('a', 'b')\ndef f():\n    TABLES['x'] = 1\n")
    assert module_state({"m": tree}) == ["m._cache: a module-level cache", "m.seen: mutable module-level state",
                                         "m:7: mutates the constant TABLES"]
