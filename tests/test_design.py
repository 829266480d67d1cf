"""The shape of the package, checked from its source: no module of ``hfpatch`` imports one that imports
it back, the call context is a leaf, only the patch ledger changes classes, and the declarations match
the code that reads them (every family's hand-off has a receiver, every receiver a family)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import hfpatch
from hfpatch.decoders import HANDS_TO

PACKAGE = Path(hfpatch.__file__).resolve().parent
MODULES = {
    ".".join(("hfpatch", *path.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(".__init__"): path
    for path in PACKAGE.rglob("*.py")
    if "bootstrap" not in path.parts  # sitecustomize: a top-level module of its own, run by the launcher
}


def _nodes(tree: ast.AST, top_only: bool) -> list[ast.AST]:
    """Every node of ``tree``; with ``top_only``, those that run at import (not inside functions)."""
    if not top_only:
        return list(ast.walk(tree))
    found, todo = [], [tree]
    while todo:
        node = todo.pop()
        found.append(node)
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            todo += list(ast.iter_child_nodes(node))
    return found


def _imports(name: str, top_only: bool = False) -> set[str]:
    """The hfpatch modules ``name`` imports, anywhere in its code (``top_only``: at import): ``from . import
    x`` counts as importing ``x`` where ``x`` is a module, else the package it is taken from."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in _nodes(ast.parse(path.read_text()), top_only):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("hfpatch"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if not source.startswith("hfpatch"):
                continue
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                found.add(submodule if submodule in MODULES else source)
    return {module for module in found if module in MODULES and module != name}


def _imports_torch_at_import(name: str) -> bool:
    for node in _nodes(ast.parse(MODULES[name].read_text()), top_only=True):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        else:
            continue
        if any(n.split(".")[0] in ("torch", "transformers") for n in names):
            return True
    return False


GRAPH = {name: _imports(name) for name in MODULES}


def test_no_module_imports_one_that_imports_it_back():
    cycles = []

    def visit(name: str, trail: list[str]) -> None:
        for target in sorted(GRAPH[name]):
            if target in trail:
                cycles.append(" -> ".join([*trail[trail.index(target) :], target]))
            elif target not in done:
                visit(target, [*trail, target])
        done.add(name)

    done: set[str] = set()
    for module in sorted(GRAPH):
        if module not in done:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(sorted(set(cycles)))


def test_the_call_context_is_a_leaf():
    """What a call reads lives in one module that imports nothing of hfpatch, nor torch."""
    assert GRAPH["hfpatch._context"] == set()
    assert not _imports_torch_at_import("hfpatch._context")
    imports = [
        n
        for n in ast.walk(ast.parse(MODULES["hfpatch._context"].read_text()))
        if "Import" in type(n).__name__
    ]
    allowed = ("__future__", "typing", "collections.abc", None)
    assert all(getattr(n, "module", None) in allowed for n in imports), imports


def test_the_observers_have_one_room():
    """The audit and the shadow subscribe through hfpatch.observers (registry, call record, call site,
    counters), which imports neither of them nor the forward, and loads no torch at import; both start
    and stop by ``engine.subscribe`` (one start), and the forward hands a call over without building
    its record."""
    subscribers = {"hfpatch.auditing", "hfpatch.judge", "hfpatch.shadowing"}
    allowed = {"hfpatch._context", "hfpatch.caches", "hfpatch._compat"}
    assert GRAPH["hfpatch.observers"] <= allowed, GRAPH["hfpatch.observers"]
    assert not _imports_torch_at_import("hfpatch.observers")
    assert "Seen(" not in MODULES["hfpatch.forward"].read_text(), "the call record is built in observers.py"
    assert all("hfpatch.forward" not in GRAPH[name] for name in subscribers)
    assert {"hfpatch.judge", "hfpatch.shadowing"} <= {
        name for name, imported in GRAPH.items() if "hfpatch.observers" in imported
    }
    for name in ("hfpatch.auditing", "hfpatch.shadowing"):
        source = MODULES[name].read_text()
        assert "engine.subscribe(" in source and "watch(" not in source.replace("engine.subscribe(", ""), name
    source = MODULES["hfpatch._context"].read_text()
    assert "WATCHERS" not in source and "SHADOW_COUNTS" not in source


def test_import_hfpatch_and_the_engine_import_no_torch_module():
    """``import hfpatch`` and ``apply()`` stay light: nothing the package or the engine imports at import
    loads torch or transformers (those modules are imported when a class is patched)."""
    heavy = {name for name in MODULES if _imports_torch_at_import(name)}
    reached, todo = set(), ["hfpatch", "hfpatch.engine"]
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo += sorted(_imports(name, top_only=True))
    assert "hfpatch._compat" in heavy, "the check must see a module that does load torch"
    assert not reached & heavy, f"imported by import hfpatch, and loads torch: {sorted(reached & heavy)}"


def test_only_the_ledger_changes_classes():
    """Every class attribute hfpatch sets or deletes goes through hfpatch/patches.py: one install loop and
    one revert loop (rows of one kind, built by hfpatch/build.py)."""
    offenders = []
    for name, path in MODULES.items():
        if name == "hfpatch.patches":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in ("__setattr__", "__delattr__")
                and isinstance(node.value, ast.Name)
                and node.value.id == "type"
            ):
                offenders.append(f"{name}:{node.lineno}")
    assert not offenders, f"class attributes changed outside the ledger: {offenders}"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_no_module_reaches_into_another_ones_privates():
    """A room is used through its public names: no ``from .x import _y``, no ``x._y`` on an imported
    hfpatch module (a private name is free to change with its own module)."""
    offenders = []
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text())
        modules = set()  # local names bound to hfpatch modules
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("hfpatch")):
                for alias in node.names:
                    if _private(alias.name):
                        offenders.append(f"{name}:{node.lineno} imports {alias.name}")
                    modules.add(alias.asname or alias.name)  # a module or not: checked below by use
            elif isinstance(node, ast.Import):
                modules.update(a.asname or a.name for a in node.names if a.name.startswith("hfpatch"))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and _private(node.attr)
                and isinstance(node.value, ast.Name)
                and node.value.id in modules
                and f"hfpatch.{node.value.id}" in MODULES
            ):
                offenders.append(f"{name}:{node.lineno} uses {node.value.id}.{node.attr}")
    assert not offenders, offenders


def test_no_module_takes_another_objects_lock():
    """An observer's counters are changed by their owner's methods (``AuditReport.count``,
    ``ShadowReport.check`` and ``skip``): no ``x._lock`` on anything but ``self``."""
    offenders = [
        f"{name}:{node.lineno}"
        for name, path in MODULES.items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute)
        and node.attr == "_lock"
        and not (isinstance(node.value, ast.Name) and node.value.id == "self")
    ]
    assert not offenders, offenders


RUNTIME = sorted(
    name
    for name in MODULES
    if not name.startswith(("hfpatch.testing", "hfpatch.verification", "hfpatch.cli"))
)


def test_the_runtime_never_imports_the_test_helpers():
    """What runs in a user's process (the patch, the audit, the shadow, the launcher) imports nothing of
    ``hfpatch.testing`` (pytest's helpers and the scenarios); of ``hfpatch.verification`` only the check
    of a class outside transformers on a tiny copy, where the package hands it to the engine."""
    offenders = []
    for name in RUNTIME:
        for target in _imports(name):
            if target.startswith("hfpatch.testing"):
                offenders.append(f"{name} -> {target}")
            elif target.startswith("hfpatch.verification") and (name, target) != (
                "hfpatch",
                "hfpatch.verification.classes",
            ):
                offenders.append(f"{name} -> {target}")
    assert not offenders, offenders


@pytest.mark.parametrize("adapter", list(hfpatch.registry().values()), ids=list(hfpatch.registry()))
def test_declarations_match_the_code_that_reads_them(adapter):
    """A family that hands its positions on has a receiver in the code and in the adapter, and only
    such a family declares one; its position module is named where the receiver needs one."""
    family = adapter.family
    if family.hands_to is None:
        assert adapter.receiver is None and family.position_module is None
        return
    assert family.hands_to in HANDS_TO, f"no receiver for {family.hands_to!r}"
    assert adapter.receiver is not None, f"{adapter.arch}: {family.hands_to!r} needs a receiver class"
    relative = family.hands_to == "relative bias"
    assert (family.position_module is None) == relative, "the relative bias is every layer's"


def _writes_attributes(tree: ast.AST) -> bool:
    """``setattr(...)`` or ``x.__dict__[...] = ...`` anywhere in ``tree``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            return True
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if (
                    isinstance(target, ast.Subscript)
                    and isinstance(target.value, ast.Attribute)
                    and target.value.attr == "__dict__"
                ):
                    return True
    return False


def test_every_change_outside_the_ledger_is_listed():
    """Modules that set attributes on objects other than their own (caches, masks, rotary modules,
    instances a descriptor serves, hooked models) are those docs/how-it-works.md lists under "What
    hfpatch changes outside the ledger", each by its file."""
    writers = {name for name, path in MODULES.items() if _writes_attributes(ast.parse(path.read_text()))}
    listed = (PACKAGE.parent / "docs" / "how-it-works.md").read_text()
    listed = listed.split("## What hfpatch changes outside the ledger")[1].split("\n## ")[0]
    unlisted = sorted(
        name
        for name in writers - {"hfpatch.patches"}  # the ledger itself
        if f"`{name.rpartition('.')[2]}.py`" not in listed and f"`{name.rpartition('.')[2]}." not in listed
    )
    assert not unlisted, f"these modules change objects, and docs/how-it-works.md does not say so: {unlisted}"


def test_the_evidence_scripts_read_their_vocabulary_from_compat():
    """compat/evidence.py, compat/report.py and compat/count_cases.py take the kinds of a result, the
    rows' fields and the random cases from compat/ (vocabulary.py, cases.py), not from the tests' own
    helpers: no ``tests`` folder on their path."""
    compat = PACKAGE.parent / "compat"
    for script in ("evidence.py", "report.py", "count_cases.py"):
        source = (compat / script).read_text()
        tree = ast.parse(source)
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert "compat.vocabulary" in imported, script
        assert not imported & {"expectations", "harness", "conftest", "probes"}, script
        assert '"tests"' not in source and "'tests'" not in source, script


def test_the_engine_is_the_api_and_the_registry():
    """engine.py keeps the public API, the registry and the install / revert of rows: the status table
    is states.py's, the watch for classes defined later custom.py's, the rebinding of hooked models
    hooks.py's (the engine calls them), in 560 lines or fewer."""
    source = MODULES["hfpatch.engine"].read_text()
    assert len(source.splitlines()) <= 560
    tree = ast.parse(source)
    called = {
        node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
    }
    assert not called & {"AdapterStatus", "get_objects"}, "the status table and the gc walk live elsewhere"
    assert "__init_subclass__" not in source and "import gc" not in source and "gc." not in source


def test_the_tolerances_are_a_leaf_every_check_reads():
    """The numbers a check holds outputs to live in hfpatch/tolerances.py, which imports nothing of
    hfpatch nor torch; verify, hfpatch.testing and the shadow read them there, not from the audit's
    rules (hfpatch.judge, which loads the positions, windows and packed rooms)."""
    assert GRAPH["hfpatch.tolerances"] == set() and not _imports_torch_at_import("hfpatch.tolerances")
    readers = (
        "hfpatch.testing",
        "hfpatch.verification.run",
        "hfpatch.verification.result",
        "hfpatch.shadowing",
    )
    for name in readers:
        assert "hfpatch.tolerances" in GRAPH[name], name
    for name in ("hfpatch.testing", "hfpatch.verification.run", "hfpatch.verification.result"):
        assert "hfpatch.judge" not in GRAPH[name], name


def test_the_fill_level_is_read_in_caches():
    """A call reads a static cache's fill level with one ``caches.past`` (the mask checked against it
    there); the forward reads no counter and no keys of its own (a growing cache's length it may read
    inline: every decode step's fast path)."""
    source = MODULES["hfpatch.forward"].read_text()
    assert "caches.past(" in source
    for name in ("fill_level", "exact_fill_level", "first_layer_keys", "cumulative_length", "COUNTER"):
        assert name not in source.replace("caches.past(", ""), name


def test_every_row_is_a_patch_from_its_factory():
    """The factories build.py calls hand back ``Patch`` rows (a receiver's methods, the sliding layer's
    ``__init__``, generate()'s input preparation, the SDPA entry): build.py unpacks no tuple into a row,
    and no row is built outside the modules that know what it replaces."""
    tree = ast.parse(MODULES["hfpatch.build"].read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Patch":
            assert not any(isinstance(arg, ast.Starred) for arg in node.args), ast.unparse(node)
            assert not any(isinstance(arg, ast.Subscript) for arg in node.args), ast.unparse(node)
    assert "Patch(" not in MODULES["hfpatch.engine"].read_text(), "the engine installs rows, builds none"


def test_the_rule_of_which_keys_a_query_sees_is_written_once():
    """``positions.keys_seen`` is the one rule (real, causal, same sequence, window, chunk); the dense
    mask and flex attention's ``BlockMask`` are its renderings: no other module compares a key's index
    with a query's, and both renderers call it."""
    compared = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
                if {"key", "query"} <= names or {"key_slots", "query_slots"} <= names:
                    compared.append(name)
    assert set(compared) == {"hfpatch.positions"}, compared
    assert MODULES["hfpatch.windows"].read_text().count("keys_seen(") == 1  # the BlockMask
    source = MODULES["hfpatch.positions"].read_text()
    assert "seen = keys_seen(" in source.split("def window_mask(")[1].split("\ndef ")[0]


def test_an_attention_backend_is_named_in_its_table_alone():
    """A backend is one row of ``hfpatch.backends.BACKENDS``: the runtime's other modules ask the row how
    to render a mask or run a packed row (``by_sequence_on``, ``backend_of``), never compare an
    implementation's name. (Declarations, the CLI's doctor and the verification models name the
    attention a tiny model is built with: those are choices, not dispatch.)"""
    from hfpatch.backends import BACKENDS

    names = {*BACKENDS, "flash_attention_2", "flash_attention_3", "paged|sdpa", "paged|eager"}
    exempt = (
        "hfpatch.backends",
        "hfpatch.cli",
        "hfpatch.verification",
        "hfpatch.adapters",
        "hfpatch.testing",
    )
    named = sorted(
        f"{name}:{node.lineno} {node.value!r}"
        for name, path in MODULES.items()
        if not name.startswith(exempt)
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and node.value in names
    )
    assert not named, named


def test_an_answer_on_packed_rows_is_read_in_one_place():
    """Whether packed rows are kept is decided in ``hfpatch.verdict`` and an answer (``"yes (how)"``, ``"no:
    why"``) is read by ``declarations.kept`` and ``why_not`` alone: no other module tests its prefix."""
    readers = sorted(
        f"{name}:{node.lineno}"
        for name, path in MODULES.items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in ("startswith", "removeprefix")
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and node.args[0].value in ("yes", "no", "no: ")
    )
    assert readers == [
        f"hfpatch.declarations:{n}"
        for n, line in enumerate(MODULES["hfpatch.declarations"].read_text().splitlines(), 1)
        if 'said.startswith("yes")' in line or 'said.removeprefix("no: ")' in line
    ], readers


def test_source_code_is_read_in_one_room():
    """Reading a function's source (``inspect.getsource``) and the patterns looked for in it (``re``) are
    hfpatch/sources.py's; the rooms that decide from the code (windows, judge, custom, packed, rope) call
    its readers (the command line's own argument patterns aside)."""
    offenders = []
    for name, path in MODULES.items():
        if name in ("hfpatch.sources", "hfpatch.cli"):
            continue
        source = path.read_text()
        if "getsource" in source or "re.compile" in source:
            offenders.append(name)
    assert not offenders, offenders
    readers = {"hfpatch.windows", "hfpatch.judge", "hfpatch.custom", "hfpatch.packed", "hfpatch.rope"}
    assert {name for name, imported in GRAPH.items() if "hfpatch.sources" in imported} >= readers
    assert GRAPH["hfpatch.sources"] == set() and not _imports_torch_at_import("hfpatch.sources")


def test_every_class_and_function_is_one_a_reader_can_hold():
    """No class or function of the package runs past 120 lines (the shadow's watcher was 232: its
    followed caches, its verdicts and its reruns are parts of their own now)."""
    long = [
        f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines"
        for name, path in MODULES.items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.end_lineno - node.lineno + 1 > 120
    ]
    assert not long, long
