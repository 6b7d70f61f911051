"""The package's structure, checked on the source: an AST walk over fastkv/.

* no import cycle among fastkv modules, counting imports at module level and inside functions
  (``if TYPE_CHECKING:`` blocks aside); importing ``fastkv.a.b`` from outside package ``a`` also
  runs ``fastkv/a/__init__.py``, so it counts as importing ``fastkv.a`` too;
* no public class name defined twice;
* at most 5 private reaches: ``x._name`` where ``x`` is not ``self``/``cls`` and ``_name`` is a
  name fastkv defines (a private name fastkv never defines belongs to another library:
  ``os._exit``, a namedtuple's ``_replace``); ``module._f`` counts unless the module is in the
  same package. The ones kept are listed in ``KEPT`` with a reason each.
"""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "fastkv"

# (module, source of the reach) -> why it stays; at most 5.
KEPT = {
    ("fastkv.engine.core", "engine._ns"): "engine package, changed in parallel by the weight-update work",
    ("fastkv.transfer.tiers", "tier._map_shm"): "alternate constructors building the class's own instance "
                                                "(transfer package, changed in parallel by the lanes work)",
    ("fastkv.transfer.tiers", "tier._open_cuda"): "as tier._map_shm",
    ("fastkv.ipc.namespace", "ns._write_manifest"): "an alternate constructor writing its own new instance's manifest",
}


def _modules() -> dict[str, tuple[Path, ast.Module]]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = ["fastkv", *path.relative_to(ROOT).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = (path, ast.parse(path.read_text(), str(path)))
    return out


MODULES = _modules()


def _package(name: str) -> str:
    path, _ = MODULES[name]
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for stmt in node.body:
                skip.update(id(n) for n in ast.walk(stmt))
    return skip


def _imports(name: str) -> tuple[set[str], dict[str, str]]:
    """fastkv modules ``name`` imports, and the local names bound to fastkv modules."""
    _, tree = MODULES[name]
    skip = _type_checking_nodes(tree)
    pkg = _package(name)
    targets: set[str] = set()
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in MODULES:
                    targets.add(alias.name)
                    if alias.asname:
                        bound[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            if base not in MODULES:
                continue
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if full in MODULES:
                    targets.add(full)
                    bound[alias.asname or alias.name] = full
                else:
                    targets.add(base)
    for t in list(targets):  # the packages on the way run their __init__ first
        parts = t.split(".")
        for i in range(2, len(parts)):
            parent = ".".join(parts[:i])
            if parent in MODULES and not (pkg + ".").startswith(parent + "."):
                targets.add(parent)
    targets.discard(name)
    return targets, bound


def import_cycles() -> list[list[str]]:
    graph = {m: _imports(m)[0] for m in MODULES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
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
                cycles.append(sorted(comp))

    for m in sorted(MODULES):
        if m not in index:
            visit(m)
    return cycles


def defined_private_names() -> set[str]:
    names = set()
    for _, tree in MODULES.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
                names.add(node.value)  # __slots__ entries
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def private_reaches() -> list[tuple[str, int, str]]:
    private = defined_private_names()
    found = []
    for name in sorted(MODULES):
        _, tree = MODULES[name]
        _, bound = _imports(name)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr in private):
                continue
            base = node.value
            if isinstance(base, ast.Name):
                if base.id in ("self", "cls"):
                    continue
                module = bound.get(base.id)
                if module is not None and _package(module) == _package(name):
                    continue
            found.append((name, node.lineno, ast.unparse(node)))
    return found


def test_no_import_cycle():
    assert import_cycles() == []


def test_no_public_class_name_defined_twice():
    where = defaultdict(list)
    for name, (_, tree) in MODULES.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                where[node.name].append(name)
    assert {c: ms for c, ms in where.items() if len(ms) > 1} == {}


def test_at_most_five_private_reaches_each_with_a_reason():
    assert len(KEPT) <= 5
    reaches = private_reaches()
    unexplained = [r for r in reaches if (r[0], r[2]) not in KEPT]
    assert unexplained == []
    assert {(m, src) for m, _, src in reaches} == set(KEPT), "a KEPT reach is gone: drop its entry"


@pytest.mark.parametrize("module", ["fastkv.ipc.messages", "fastkv.ipc.codec"])
def test_ipc_imports_nothing_from_cache(module):
    assert not any(t.startswith("fastkv.cache") for t in _imports(module)[0])


def _facade() -> set[str]:
    """CacheManager's own methods and properties, and the config it was built with."""
    _, tree = MODULES["fastkv.cache.manager"]
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CacheManager")
    methods = {n.name for n in cls.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")}
    return methods | {"config", "block_size"}


@pytest.mark.parametrize("package, counters", [("fastkv.sched", False), ("fastkv.engine", True)])
def test_package_uses_only_the_cache_facade(package, counters):
    """The facade rule: fastkv.sched and fastkv.engine reach the cache through CacheManager's
    methods (the engine also reads its counters), never the pools, copies or index behind it,
    nor a role module of fastkv.cache."""
    allowed = _facade() | ({"stats"} if counters else set())
    roles = {"fastkv.cache.handoff", "fastkv.cache.state", "fastkv.cache.tiering", "fastkv.cache.offload",
             "fastkv.cache.completions", "fastkv.cache.release", "fastkv.cache.storage_writes"}
    past = []
    for name in sorted(MODULES):
        if not name.startswith(package):
            continue
        imported = _imports(name)[0]
        # the scheduler is handed its manager; in an engine module that imports no part of
        # fastkv.cache, a ``cache`` is a KV tensor
        if package == "fastkv.engine" and not any(t.startswith("fastkv.cache") for t in imported):
            continue
        for node in ast.walk(MODULES[name][1]):
            if not isinstance(node, ast.Attribute) or node.attr in allowed:
                continue
            base = node.value
            if (isinstance(base, ast.Name) and base.id == "cache") or \
                    (isinstance(base, ast.Attribute) and base.attr == "cache"):
                past.append((name, node.lineno, ast.unparse(node)))
        past += [(name, 0, f"imports {t}") for t in imported & roles]
    assert past == []


# ---------------------------------------------------------------- the cache state's owners
_MUTATORS = {"append", "extend", "insert", "remove", "pop", "popitem", "clear", "update", "setdefault",
             "move_to_end", "add", "discard", "sort", "reverse"}
# CacheState attributes another module may change in place, each with why
STATE_KEPT = {
    ("fastkv.cache.residency", "device"): "KV events wrap the pools' and the index's key maps in observed "
                                          "ones, once, when they are turned on",
    ("fastkv.cache.residency", "host"): "as device",
    ("fastkv.cache.residency", "index"): "as device",
}
COUNTERS = {"stats"}  # CacheStats: a set of counters every role module adds to


def _state_attributes() -> set[str]:
    tree = MODULES["fastkv.cache.state"][1]
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CacheState")
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    return {t.attr for n in ast.walk(init) if isinstance(n, (ast.Assign, ast.AnnAssign))
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}


def _state_attribute(node: ast.expr, attrs: set[str], aliases: dict[str, str]) -> str | None:
    """The CacheState attribute ``node`` is, or is part of: ``state.A``, ``self.state.A[k].f``,
    or a local name bound to ``state.A`` (None: not one)."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        inner = node.value
        if isinstance(node, ast.Attribute) and node.attr in attrs and (
                (isinstance(inner, ast.Name) and inner.id == "state")
                or (isinstance(inner, ast.Attribute) and inner.attr == "state")):
            return node.attr
        node = inner
    if isinstance(node, ast.Name):
        return aliases.get(node.id)
    return None


def state_changes(tree: ast.Module, attrs: set[str]) -> set[str]:
    """The CacheState attributes a module rebinds or changes in place: an Assign / AugAssign /
    AnnAssign / del target in one, or a container-mutating call on one (through local aliases
    too), the counters aside."""
    found: set[str] = set()
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        aliases: dict[str, str] = {}
        for node in ast.walk(fn):  # aliases first: ``x = state.A`` or ``x, y = state.A, state.B``
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    pairs = zip(t.elts, node.value.elts, strict=False) if isinstance(t, ast.Tuple) and \
                        isinstance(node.value, ast.Tuple) else [(t, node.value)]
                    for name, value in pairs:
                        a = _state_attribute(value, attrs, {})
                        if isinstance(name, ast.Name) and a is not None:
                            aliases[name.id] = a
        for node in ast.walk(fn):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            elif isinstance(node, ast.Delete):
                targets = node.targets
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _MUTATORS:
                targets = [node.func.value]
            for t in targets:
                for leaf in (t.elts if isinstance(t, ast.Tuple) else [t]):
                    if isinstance(leaf, ast.Name) and not isinstance(node, ast.Call):
                        continue  # rebinding a local name changes nothing
                    a = _state_attribute(leaf, attrs, aliases)
                    if a is not None and a not in COUNTERS:
                        found.add(a)
    return found


def test_each_cache_state_attribute_is_changed_in_one_module():
    """Each piece of CacheState is assigned in state.py alone, and changes only through its
    own class's methods: no role module rebinds one or mutates its containers."""
    attrs = _state_attributes()
    assert {"reservations", "weights", "through", "preemptions", "flush", "handoff_holds"} <= attrs
    where: dict[str, set[str]] = defaultdict(set)
    for name, (_, tree) in MODULES.items():
        if name == "fastkv.cache.state":
            continue
        for a in state_changes(tree, attrs):
            if (name, a) not in STATE_KEPT:
                where[a].add(name)
    assert dict(where) == {}


def test_the_state_check_catches_a_second_module():
    attrs = {"reservations", "through", "reqs"}
    src = ("def f(state, self):\n"
           "    state.reservations.total += 1\n"
           "    skipped = state.through.skipped\n"
           "    skipped.popitem()\n"
           "    self.state.reqs[1] = 2\n"
           "    x = state.reqs.get(1)\n")
    assert state_changes(ast.parse(src), attrs) == {"reservations", "through", "reqs"}
    assert state_changes(ast.parse("def f(state):\n    state.through.skip(1)\n"), attrs) == set()


# ---------------------------------------------------------------- records: small, no sentinels
def _dataclass_fields(module: str, cls_name: str) -> list[str]:
    tree = MODULES[module][1]
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls_name)
    return [n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]


def _fixed(module: str, cls_name: str) -> tuple[str, ...]:
    tree = MODULES[module][1]
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls_name)
    for n in cls.body:
        if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "FIXED" for t in n.targets):
            return tuple(ast.literal_eval(n.value))
    return ()


# record class -> the names fastkv.cache binds its instances to
RECORDS = {("fastkv.cache.requests", "CacheRecord"): {"req", "owner", "record"},
           ("fastkv.cache.requests", "LoadProgress"): {"load"},
           ("fastkv.cache.requests", "ChainHold"): {"chain"},
           ("fastkv.cache.requests", "Resume"): {"resume"},
           ("fastkv.cache.copies", "CopyRecord"): {"rec", "child"}}


@pytest.mark.parametrize("module,cls_name", sorted(RECORDS))
def test_records_have_at_most_12_mutable_fields(module, cls_name):
    """A record's fields less those it declares FIXED (set at construction, never rebound:
    checked below, on the names its instances go by) are at most 12."""
    names = RECORDS[module, cls_name]
    fields = _dataclass_fields(module, cls_name)
    fixed = _fixed(module, cls_name)
    assert set(fixed) <= set(fields)
    assert len(fields) - len(fixed) <= 12, f"{cls_name}: {len(fields) - len(fixed)} mutable fields"
    rebound = [(name, node.lineno) for name, (_, tree) in MODULES.items() if name.startswith("fastkv.cache")
               for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AugAssign))
               for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
               if isinstance(t, ast.Attribute) and t.attr in fixed
               and isinstance(t.value, ast.Name) and t.value.id in names]
    assert rebound == []


def test_no_sentinel_for_none_in_the_cache_records():
    """``None`` or a type stands for "none": no ``1 << 62``, no ``-1`` default or fill."""
    found = []
    for name in ("fastkv.cache.requests", "fastkv.cache.copies", "fastkv.cache.manager", "fastkv.cache.offload",
                 "fastkv.cache.completions", "fastkv.cache.tiering", "fastkv.cache.release", "fastkv.cache.handoff",
                 "fastkv.cache.storage_writes", "fastkv.cache.state"):
        tree = MODULES[name][1]
        indices = {id(n) for sub in ast.walk(tree) if isinstance(sub, ast.Subscript) for n in ast.walk(sub.slice)}
        indices |= {id(n) for call in ast.walk(tree) if isinstance(call, ast.Call) and
                    isinstance(call.func, ast.Name) and call.func.id == "range" for n in ast.walk(call)}
        for node in ast.walk(tree):
            if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and \
                    isinstance(node.operand, ast.Constant) and node.operand.value == 1 and id(node) not in indices:
                found.append((name, node.lineno, "-1"))  # an index or a range step is no sentinel
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.LShift) and \
                    isinstance(node.right, ast.Constant) and node.right.value >= 32:  # a "never" past any count
                found.append((name, node.lineno, ast.unparse(node)))
    assert found == []
