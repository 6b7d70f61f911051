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
    ("fastkv.engine.runners.paddleformers.runner", "decoder._prepare_decoder_attention_mask"):
        "PaddleFormers' own method, wrapped: the library windows a sliding layer only in masks it builds, "
        "and offers no hook for a 4-D mask given to it",
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


def _public_classes(body: list[ast.stmt]):
    """Classes a module exports: at its top level or inside its classes. Classes local to a
    function are not names anyone imports (a wire schema's structs, built per schema, are)."""
    for node in body:
        if isinstance(node, ast.ClassDef):
            if not node.name.startswith("_"):
                yield node.name
            yield from _public_classes(node.body)


def test_no_public_class_name_defined_twice():
    where = defaultdict(list)
    for name, (_, tree) in MODULES.items():
        for cls in _public_classes(tree.body):
            where[cls].append(name)
    assert {c: ms for c, ms in where.items() if len(ms) > 1} == {}


def test_at_most_five_private_reaches_each_with_a_reason():
    assert len(KEPT) <= 5
    reaches = private_reaches()
    unexplained = [r for r in reaches if (r[0], r[2]) not in KEPT]
    assert unexplained == []
    assert {(m, src) for m, _, src in reaches} == set(KEPT), "a KEPT reach is gone: drop its entry"


# The package's floors, lowest first: a unit (a package under fastkv/, or a module at its root)
# imports only units on a floor below its own. A new package or root module is placed here.
FLOORS = [
    ("fastkv.config", "fastkv.native", "fastkv.deploy"),
    ("fastkv.ipc", "fastkv.cache", "fastkv.storage"),
    ("fastkv.kernels", "fastkv.procs", "fastkv.events", "fastkv.routing", "fastkv.sched", "fastkv.workload"),
    ("fastkv.run",),
    ("fastkv.transfer",),
    ("fastkv.launch",),
    ("fastkv.engine",),
    ("fastkv.cli",),
    ("fastkv.__main__",),
]
FLOOR = {unit: i for i, units in enumerate(FLOORS) for unit in units}


def _unit(module: str) -> str:
    return ".".join(module.split(".")[:2])


def upward_imports() -> list[tuple[str, str]]:
    """(importer, imported) pairs whose imported unit is not on a lower floor."""
    return sorted((m, t) for m in MODULES if m != "fastkv" for t in _imports(m)[0]
                  if t != "fastkv" and _unit(m) != _unit(t) and FLOOR[_unit(t)] >= FLOOR[_unit(m)])


def test_every_unit_is_on_a_floor():
    assert sorted({_unit(m) for m in MODULES if m != "fastkv"} - FLOOR.keys()) == []


def test_no_package_imports_one_on_its_floor_or_above():
    assert upward_imports() == []


def test_the_layer_check_sees_an_import_going_up(monkeypatch):
    """The check above on a mutant: the transfer process importing the engine's cost model."""
    tree = ast.parse("from fastkv.engine import metrics\n")
    monkeypatch.setitem(MODULES, "fastkv.transfer.mutant", (ROOT / "transfer" / "mutant.py", tree))
    assert ("fastkv.transfer.mutant", "fastkv.engine.metrics") in upward_imports()


@pytest.mark.parametrize("package", ["fastkv.transfer", "fastkv.cache", "fastkv.storage", "fastkv.ipc"])
def test_the_lower_packages_never_import_the_engine(package):
    assert [(m, t) for m in MODULES if _unit(m) == package for t in _imports(m)[0]
            if t.startswith("fastkv.engine")] == []


def test_the_root_holds_at_most_four_modules():
    loose = sorted(p.name for p in ROOT.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert len(loose) <= 4, loose


@pytest.mark.parametrize("module", ["fastkv.ipc.messages", "fastkv.ipc.codec"])
def test_ipc_imports_nothing_from_cache(module):
    assert not any(t.startswith("fastkv.cache") for t in _imports(module)[0])


def _facade() -> set[str]:
    """CacheManager's own methods and properties, and the config it was built with."""
    _, tree = MODULES["fastkv.cache.manager"]
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CacheManager")
    methods = {n.name for n in cls.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")}
    return methods | {"config", "block_size"}


def _pairs(node: ast.Assign | ast.AnnAssign | ast.NamedExpr) -> list[tuple[ast.expr, ast.expr]]:
    """(target, value) of an assignment, tuples unpacked pairwise: ``a, b = x, y``."""
    if node.value is None:
        return []
    out = []
    for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
        if isinstance(t, ast.Tuple) and isinstance(node.value, ast.Tuple):
            out += zip(t.elts, node.value.elts, strict=False)
        else:
            out.append((t, node.value))
    return out


def cache_aliases(tree: ast.Module) -> tuple[set[str], set[str]]:
    """The names and attributes a module binds the cache manager to: ``cache`` and ``x.cache``,
    a parameter annotated ``CacheManager``, and whatever is assigned one of them (``cm =
    self.cache``, ``self.cm = cache``), to a fixed point."""
    names, attrs = {"cache"}, {"cache"}
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and node.annotation is not None and \
                "CacheManager" in ast.unparse(node.annotation):
            names.add(node.arg)
    assigns = [pair for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AnnAssign, ast.NamedExpr))
               for pair in _pairs(node)]
    while True:
        before = len(names) + len(attrs)
        for target, value in assigns:
            if (isinstance(value, ast.Name) and value.id in names) or \
                    (isinstance(value, ast.Attribute) and value.attr in attrs):
                if isinstance(target, ast.Name):
                    names.add(target.id)
                elif isinstance(target, ast.Attribute):
                    attrs.add(target.attr)
        if len(names) + len(attrs) == before:
            return names, attrs


def facade_breaches(module: str, tree: ast.Module, allowed: set[str]) -> list[tuple[str, int, str]]:
    """Attributes read off the cache manager, under any name it is bound to, that are not in
    ``allowed``."""
    names, attrs = cache_aliases(tree)
    return [(module, node.lineno, ast.unparse(node)) for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr not in allowed
            and ((isinstance(node.value, ast.Name) and node.value.id in names)
                 or (isinstance(node.value, ast.Attribute) and node.value.attr in attrs))]


def test_the_facade_check_follows_aliases_of_the_manager():
    src = ("def f(self, mgr: CacheManager):\n"
           "    cm = self.cache\n"
           "    cm.copies.records.clear()\n"
           "    self.kept = cm\n"
           "    self.kept.device.num_free\n"
           "    mgr.host\n"
           "    cm.free(1)\n"
           "    other.device\n")
    found = {src for _, _, src in facade_breaches("m", ast.parse(src), {"free"})}
    assert found == {"cm.copies", "self.kept.device", "mgr.host"}


@pytest.mark.parametrize("package, counters", [("fastkv.sched", False), ("fastkv.engine", True)])
def test_package_uses_only_the_cache_facade(package, counters):
    """The facade rule: fastkv.sched and fastkv.engine reach the cache through CacheManager's
    methods (the engine also reads its counters), under any name it is bound to, never the pools,
    copies or index behind it, nor a role module of fastkv.cache."""
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
        past += facade_breaches(name, MODULES[name][1], allowed)
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


def _state_attribute(node: ast.expr, attrs: set[str], aliases: dict[str, str], roots: set[str] = frozenset(),
                     self_aliases: dict[str, str] | None = None) -> str | None:
    """The CacheState attribute ``node`` is, or is part of: ``state.A``, ``self.state.A[k].f``,
    ``st.A`` where ``st`` is a local name bound to the state, ``self.X`` where the module bound
    ``self.X`` to ``state.A`` (``self_aliases``), or a local name bound to ``state.A`` (None: not one)."""
    self_aliases = self_aliases or {}
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        inner = node.value
        if isinstance(node, ast.Attribute):
            if node.attr in attrs and (
                    (isinstance(inner, ast.Name) and (inner.id == "state" or inner.id in roots))
                    or (isinstance(inner, ast.Attribute) and inner.attr == "state")):
                return node.attr
            if isinstance(inner, ast.Name) and inner.id == "self" and node.attr in self_aliases:
                return self_aliases[node.attr]
        node = inner
    if isinstance(node, ast.Name):
        return aliases.get(node.id)
    return None


def _is_state(node: ast.expr, roots: set[str]) -> bool:
    """``state``, ``x.state`` or a local name bound to one."""
    return (isinstance(node, ast.Name) and (node.id == "state" or node.id in roots)) or \
        (isinstance(node, ast.Attribute) and node.attr == "state")


def _function_aliases(fn: ast.AST, attrs: set[str], self_aliases: dict[str, str]) -> tuple[dict[str, str], set[str]]:
    """A function's local names bound to a CacheState attribute (``x = state.A``, ``x, y =
    state.A, state.B``, ``x = self.X`` with ``self.X`` one) and to the state itself (``st =
    self.state``), to a fixed point."""
    aliases: dict[str, str] = {}
    roots: set[str] = set()
    pairs = [pair for node in ast.walk(fn) if isinstance(node, (ast.Assign, ast.AnnAssign, ast.NamedExpr))
             for pair in _pairs(node)]
    while True:
        before = len(aliases) + len(roots)
        for name, value in pairs:
            if not isinstance(name, ast.Name):
                continue
            if _is_state(value, roots):
                roots.add(name.id)
            elif (a := _state_attribute(value, attrs, aliases, roots, self_aliases)) is not None:
                aliases[name.id] = a
        if len(aliases) + len(roots) == before:
            return aliases, roots


def _self_aliases(tree: ast.Module, attrs: set[str]) -> dict[str, str]:
    """Instance attributes a module binds to a CacheState attribute: ``self._reqs = state.reqs``."""
    out: dict[str, str] = {}
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        aliases, roots = _function_aliases(fn, attrs, {})
        for node in ast.walk(fn):
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                for t, value in _pairs(node):
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        a = _state_attribute(value, attrs, aliases, roots)
                        if a is not None:
                            out[t.attr] = a
    return out


def _own_methods() -> dict[str, set[str]]:
    """CacheState attribute -> the methods of its own fastkv class (``self.index = PrefixIndex(...)``):
    ``state.index.clear()`` is the index's own method, not a container's."""
    classes = {n.name: {f.name for f in n.body if isinstance(f, ast.FunctionDef)}
               for _, tree in MODULES.values() for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    tree = MODULES["fastkv.cache.state"][1]
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CacheState")
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    return {t.attr: classes[n.value.func.id] for n in ast.walk(init) if isinstance(n, ast.Assign)
            for t in n.targets if isinstance(t, ast.Attribute) and isinstance(n.value, ast.Call)
            and isinstance(n.value.func, ast.Name) and n.value.func.id in classes}


def _own_method_call(node: ast.expr, attrs: set[str], self_aliases: dict[str, str], roots: set[str]) -> bool:
    """``state.A.m(...)`` or ``self.X.m(...)`` (``self.X`` bound to ``state.A``) where ``m`` is
    a method of A's own class."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
        return False
    recv = node.func.value
    if not isinstance(recv, ast.Attribute):
        return False
    if isinstance(recv.value, ast.Name) and recv.value.id == "self" and recv.attr in self_aliases:
        a = self_aliases[recv.attr]
    elif recv.attr in attrs and _is_state(recv.value, roots):
        a = recv.attr
    else:
        return False
    return node.func.attr in OWN_METHODS.get(a, ())


def state_changes(tree: ast.Module, attrs: set[str]) -> set[str]:
    """The CacheState attributes a module rebinds or changes in place: an Assign / AugAssign /
    AnnAssign / del target in one, or a container-mutating call on one, however it is reached
    (the state or the attribute bound to a local name or to an instance attribute), the counters
    aside."""
    found: set[str] = set()
    self_aliases = _self_aliases(tree, attrs)
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        aliases, roots = _function_aliases(fn, attrs, self_aliases)
        for node in ast.walk(fn):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            elif isinstance(node, ast.Delete):
                targets = node.targets
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _MUTATORS \
                    and not _own_method_call(node, attrs, self_aliases, roots):
                targets = [node.func.value]
            for t in targets:
                for leaf in (t.elts if isinstance(t, ast.Tuple) else [t]):
                    if isinstance(leaf, ast.Name) and not isinstance(node, ast.Call):
                        continue  # rebinding a local name changes nothing
                    if isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name) and \
                            leaf.value.id == "self" and leaf.attr in self_aliases and not isinstance(node, ast.Call):
                        continue  # binding the alias itself (in __init__) changes no state
                    a = _state_attribute(leaf, attrs, aliases, roots, self_aliases)
                    if a is not None and a not in COUNTERS:
                        found.add(a)
    return found


OWN_METHODS = _own_methods()


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
    aliased = ("class M:\n"
               "    def __init__(self, config):\n"
               "        self.state = state = State(config)\n"
               "        self._reqs = state.reqs\n"
               "    def free(self, rid):\n"
               "        self._reqs.pop(rid)\n"
               "    def skip(self):\n"
               "        st = self.state\n"
               "        st.through.skipped.clear()\n"
               "    def count(self):\n"
               "        st = self.state\n"
               "        st.reservations.total += 1\n")
    assert state_changes(ast.parse(aliased), attrs) == {"reqs", "through", "reservations"}


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
