"""The layers of the tree (DESIGN.md §2), as its imports show them, and the shape of analyses/.

- The layers: the contracts (the modules at the top of tracekit/: schema, store, policy, manifest, ...)
  import only each other; the trainer (tracekit/dlrm), the collectors and the analyses import the
  contracts and themselves; the reports add the analyses; only the commands (tracekit/app) import
  everything. No module of the tree is part of an import cycle.
- The traced process stays lean (collectors import no duckdb, polars or plotly) and analysis runs
  without torch (analyses and reports import no torch).
- No analysis keeps state at module level: what an analysis derives lives on the Context (`ctx.memo`).

Every check reads the source with `ast`, so it covers imports inside functions and under `if
TYPE_CHECKING:` too (a guard that hides a cycle is still a cycle)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "analyses"
TREE = ("tracekit", "collectors", "analyses", "reports")
MAY_IMPORT = {
    "contracts": {"contracts"},
    "tracekit.dlrm": {"contracts", "tracekit.dlrm"},
    "collectors": {"contracts", "collectors"},
    "analyses": {"contracts", "analyses"},
    "reports": {"contracts", "analyses", "reports"},
    "tracekit.app": {"contracts", "tracekit.dlrm", "collectors", "analyses", "reports", "tracekit.app"},
}
"""Each layer of the tree and the layers its modules may import."""
NOT_IMPORTED = {"collectors": {"duckdb", "polars", "plotly"}, "analyses": {"torch"}, "reports": {"torch"}}
"""Third-party packages a layer never imports, not even inside a function."""
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


def layer(module: str) -> str:
    """The layer of a module of the tree: its package, or "contracts" for the top of tracekit/ (but for
    tracekit/__main__.py, `python -m tracekit`: a command)."""
    if module == "tracekit.__main__":
        return "tracekit.app"
    parts = module.split(".")
    if parts[0] != "tracekit":
        return parts[0]
    return f"tracekit.{parts[1]}" if len(parts) > 1 and f"tracekit.{parts[1]}" in MAY_IMPORT else "contracts"


def whole_tree() -> dict[str, ast.Module]:
    return {name: tree for package in TREE for name, tree in modules(package).items()}


def top_level_imports(tree: ast.Module) -> set[str]:
    """The top-level package of every absolute import in `tree`, wherever it stands."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.partition(".")[0])
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


def test_each_layer_imports_only_the_layers_below_it() -> None:
    trees = whole_tree()
    known = set(trees)
    assert layer("tracekit.policy") == "contracts" and layer("tracekit.app.cli") == "tracekit.app"
    wrong = [f"{name} ({layer(name)}) imports {target} ({layer(target)})"
             for name, tree in trees.items() for target in sorted(imported(name, tree, known))
             if layer(target) not in MAY_IMPORT[layer(name)]]
    assert not wrong, "\n".join(wrong)


def test_the_layers_keep_their_heavy_imports_apart() -> None:
    wrong = [f"{name} imports {package}" for name, tree in whole_tree().items()
             for package in sorted(top_level_imports(tree) & NOT_IMPORTED.get(layer(name), set()))]
    assert not wrong, "\n".join(wrong)


def test_the_whole_tree_has_no_import_cycle() -> None:
    trees = whole_tree()
    graph = {name: imported(name, tree, set(trees)) for name, tree in trees.items()}
    assert "tracekit.policy" in graph["tracekit.dlrm.policies"]  # the parse sees imports across packages
    found = cycle(graph)
    assert found is None, "import cycle: " + " -> ".join(found)


def test_the_layer_check_sees_a_contract_that_imports_an_analysis() -> None:
    trees = {"tracekit": ast.parse(""), "tracekit.store": ast.parse("def f():\n    from analyses import x"),
             "analyses": ast.parse(""), "analyses.x": ast.parse("")}
    targets = imported("tracekit.store", trees["tracekit.store"], set(trees))
    assert {layer(t) for t in targets} == {"analyses"} and "analyses" not in MAY_IMPORT["contracts"]


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
