"""The public API and the registry: one lock, one table of adapters, and the same install / revert /
report for every one of them.

An adapter's patch is installed when something wants it (``apply()``, or a ``patched()`` block still
open in some thread), its release range admits the installed transformers (or ``apply(...,
ignore_ranges=True)`` said to patch it anyway), and its module has been imported: at once if it already
was, otherwise from a wrapt post-import hook when the user imports it. ``apply()`` itself imports no
``transformers.models`` module. It installs rows (:mod:`hfpatch.patches`) that replace the class's own
``forward``, so models built earlier are fixed too.

Who gets the patched result: ``apply()`` pins an adapter for the whole process (until ``revert()``).
``patched()`` and ``unpatched()`` blocks decide for their own thread only (like ``torch.no_grad()``):
the installed forward reads this thread's choice (:data:`hfpatch._context.CALL`) at each eager call,
so a block in one thread never changes what another thread computes. Compiled code reads the same
(dynamo guards on the pin and the thread's choice, and traces again when they change).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import Any, Optional, Union

from . import custom
from ._context import (
    PACKED,
    UNPAD,
    UNPADDED,
    close_block,
    open_block,
    read_packed,
    read_unpad,
    warn_once,
)
from .adapters import ADAPTERS, UNDECLARED
from .declarations import Adapter, Undeclared
from .hooks import rebind_hooked
from .observers import SHADOW_COUNTS, unwatch, watch
from .patches import Ledger, Patch
from .states import (
    APPLIED,
    CHECKING,
    NOT_APPLIED,
    SKIPPED,
    WAITING,
    AdapterState,
    AdapterStatus,
    Status,
    nearest,
    new_types,
    table,
)
from .support import (
    NEWEST_TESTED,
    UNTESTED_NEWER,
    installed_transformers,
    support,
)

__all__ = [  # (the state names and the status types are states.py's, named here too)
    "APPLIED",
    "CHECKING",
    "NOT_APPLIED",
    "SKIPPED",
    "WAITING",
    "AdapterStatus",
    "Status",
    "Held",
    "adapter_for",
    "apply",
    "patchable",
    "hold",
    "patched",
    "registry",
    "release",
    "revert",
    "select",
    "status",
    "subscribe",
    "unpatched",
]


Archs = Union[str, Iterable[str], None]


_lock = threading.RLock()
_registry: dict[str, Adapter] = {}
_undeclared: dict[str, Undeclared] = {}
_aliases: dict[str, str] = {}  # model type -> the adapter that patches its class
_states: dict[str, AdapterState] = {}
_left_alone: dict[str, str] = {}  # classes outside transformers that look like decoders, not patched: why
_ledger = Ledger()
_applied_by: list[str] = []  # how apply() was called in this process, when not by the program itself
_environment_read: list[bool] = []  # HFPATCH_PACKED and HFPATCH_UNPAD read (by the first apply())


def _register() -> None:
    """The declarations (:mod:`hfpatch.adapters`), in their order; a model type declared twice raises."""
    for adapter in ADAPTERS:
        for name in (adapter.arch, *adapter.aliases):
            if name in _registry or name in _aliases:
                raise ValueError(f"model type {name!r} is declared twice")
        _registry[adapter.arch] = adapter
        _states[adapter.arch] = AdapterState(adapter)
        _aliases.update((alias, adapter.arch) for alias in adapter.aliases)
    for entry in UNDECLARED:
        if entry.arch in _registry or entry.arch in _aliases or entry.arch in _undeclared:
            raise ValueError(f"model type {entry.arch!r} is declared twice")
        _undeclared[entry.arch] = entry


_register()


def registry() -> Mapping[str, Adapter]:
    """A read-only view of every adapter, by architecture (``config.model_type``), in registry order.

    >>> hfpatch.registry()["llama"].cls
    'LlamaModel'
    """
    return MappingProxyType(_registry)


def adapter_for(arch: str) -> Optional[Adapter]:
    """The adapter that patches ``arch``'s class (``arch`` may be an alias, like ``exaone``), or None."""
    return _registry.get(_aliases.get(arch, arch))


def patchable(arch: str) -> bool:
    """Whether the adapter of ``arch`` patches the installed release: its range admits it (tested, or
    untested newer), or ``apply(..., ignore_ranges=True)`` asked for it, and its class, where its module
    has been imported, is the one it patches."""
    adapter = adapter_for(arch)
    if adapter is None:
        return False
    with _lock:
        state = _states[adapter.arch]
        allowed = state.forced or support(adapter, installed_transformers()).patchable
        return allowed and not state.class_differs and (state.checked is not False or state.forced)


def apply(
    archs: Archs = None,
    *,
    ignore_ranges: bool = False,
    packed: Optional[bool] = None,
    unpad: Optional[bool] = None,
) -> Status:
    """Patch every registered adapter (or the named model types) whose release range admits the
    installed transformers. Idempotent and thread-safe; never raises because of the installed release.
    ``ignore_ranges=True`` patches them on this release whatever their declared range says (an
    unverified release, an older one, a known-bad one: where the class and its signature match), until
    ``revert()``; ``status()`` still shows their support. ``packed=False`` leaves rows whose positions
    restart (several sequences packed into one row) to stock for the whole process, for layouts where
    such positions mean something else; ``True`` keeps them to their sequences again (the default; None:
    as it was, or at the process's first ``apply()``, as ``HFPATCH_PACKED`` says where it is set).
    ``unpad=True`` runs a padded call on its real tokens alone (:mod:`hfpatch.unpad`; a task head's
    hooks and forward hooks on layers see one packed row), for the whole process; ``False``: padded, as
    transformers runs it (the default; None: as it was, or ``HFPATCH_UNPAD`` at the first ``apply()``).

    >>> import hfpatch
    >>> hfpatch.apply()                # doctest: +SKIP
    >>> hfpatch.apply(["qwen2"])       # doctest: +SKIP
    """
    if packed is not None and not isinstance(packed, bool):
        raise TypeError(f"packed: expected True, False or None, got {packed!r}")
    if unpad is not None and not isinstance(unpad, bool):
        raise TypeError(f"unpad: expected True, False or None, got {unpad!r}")
    if not isinstance(ignore_ranges, bool):
        raise TypeError(f"ignore_ranges: expected True or False, got {ignore_ranges!r}")
    with _lock:
        if not _environment_read:  # a ValueError naming a variable, for a value it cannot read
            packed = read_packed(os.environ) if packed is None else packed
            unpad = read_unpad(os.environ) if unpad is None else unpad
        _environment_read.append(True)
        if packed is not None:
            PACKED[0] = packed
        if unpad is not None:
            UNPAD[0] = unpad
        if archs is None:
            _discover()
            _WATCH.start()  # a class defined later: installed unpinned, checked at its first call
        names = select(archs)
    if not ignore_ranges:
        _check_classes(names)  # outside the lock
    with _lock:
        installed = _want(names, holder=None, force=ignore_ranges)
        rebind_hooked(installed)
        return status()


def _want(
    names: list[str], holder: Optional[object], force: bool = False, at_first_call: bool = False
) -> list[Patch]:
    """Pin ``names`` (``holder`` None) or hold them for a ``patched()`` block; install what can be.
    ``at_first_call``: a custom class not checked yet is installed unpinned, its check left to its first
    call (:func:`_first_call`). Returns the rows installed now."""
    version = installed_transformers()
    refused, untested, installed = [], [], []
    for name in names:
        state = _states[name]
        verdict = support(state.adapter, version)
        if force and version is not None:
            state.forced = True
        if not (verdict.patchable or state.forced):
            state.skip_reason = verdict.reason
            refused.append((name, verdict.reason))
            continue
        if at_first_call and state.owner is not None and state.checked is None and not state.forced:
            state.skip_reason = None
            installed += _install(state, custom.namespace(state.owner))
            if state.installed:
                state.pin.awaiting = functools.partial(_first_call, name)
            continue
        if state.owner is not None and not state.forced and not _checked(state):
            state.skip_reason = state.check_reason
            refused.append((name, state.check_reason))
            continue
        if verdict.level == UNTESTED_NEWER and name in _registry:
            untested.append(name)
        if holder is None:
            state.pin.pinned = True
            state.pin.awaiting = None
        else:
            state.holders.add(holder)
        state.skip_reason = None
        module = (
            custom.namespace(state.owner)
            if state.owner is not None
            else sys.modules.get(state.adapter.module)
        )
        if module is not None:
            installed += _install(state, module)
        elif not state.hooked:
            import wrapt  # about 8 ms, so only when a module must be waited for

            wrapt.register_post_import_hook(_hook(name), state.adapter.module)
            state.hooked = True
    # (a custom class: status says; a class that only warns of packed rows fixes nothing)
    declared = {name for name in names if _states[name].owner is None and name in _registry}
    if declared and declared <= {name for name, _ in refused}:
        reasons = "; ".join(dict.fromkeys(why for name, why in refused if name in declared))
        warn_once(("nothing",), f"hfpatch patches nothing for transformers {version}: {reasons}", 3)
    if untested:
        warn_once(
            ("untested",),
            f"hfpatch is not tested with transformers {version} (newest tested: {NEWEST_TESTED}): "
            f"{len(untested)} model types patched as their signatures match; hfpatch.status() lists them",
            3,
        )
    return installed


def revert(archs: Archs = None) -> Status:
    """Restore the exact original class attributes of every adapter (or the named ones), whoever applied
    them; a replacement someone else made after hfpatch's stays."""
    with _lock:
        if archs is None:
            _WATCH.stop()
        for name in select(archs):
            state = _states[name]
            state.pin.pinned = state.forced = False
            state.pin.awaiting = None
            state.holders.clear()
            _uninstall(state)
        return status()


@contextlib.contextmanager
def patched(archs: Archs = None) -> Iterator[Status]:
    """Patched results in this thread inside the block (every adapter, or the named ones), whatever
    ``apply()`` says; other threads are not affected. On exit the thread's previous choice is back, and
    a patch installed only for this block is removed. Blocks nest; ``revert()`` inside one wins.

    >>> with hfpatch.patched():        # doctest: +SKIP
    ...     logits = model(input_ids, attention_mask=mask).logits
    """
    token = hold(archs)
    previous = open_block(dict.fromkeys(token.names, True))
    try:
        yield status()
    finally:
        close_block(previous)
        release(token)


class Held:
    """What :func:`hold` installed for its caller: the adapters' names; compared by identity."""

    __slots__ = ("names",)

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names


def hold(archs: Archs = None) -> Held:
    """Install the patch of every adapter (or the named ones) without patching a call: every call
    stays what it was (stock, unless ``apply()`` or a ``patched()`` block says otherwise) until
    :func:`release`. For ``patched()`` blocks and the observers of calls (:mod:`hfpatch.audit`,
    :mod:`hfpatch.shadow`)."""
    with _lock:
        if archs is None:
            _discover()
        names = select(archs)
    _check_classes(names)  # outside the lock
    with _lock:
        token = Held(tuple(names))
        first = [name for name in names if not _states[name].rows]
        installed = _want(names, holder=token)
        # models accelerate hooked before hfpatch was ever installed: found once, at the first install
        rebind_hooked([row for row in installed if any(row in _states[name].rows for name in first)])
    return token


def release(token: Held) -> None:
    """Undo a :func:`hold`: a patch nothing else wants is removed."""
    with _lock:
        for name in token.names:
            state = _states[name]
            state.holders.discard(token)
            if not state.wanted:
                _uninstall(state)


def subscribe(watcher: Callable) -> Callable[[], None]:
    """Observe every patched forward's calls (``watcher``: :func:`hfpatch.observers.watch`), every patch
    installed without patching a call (:func:`hold`); returns the function that undoes both. The one
    start of the audit and the shadow."""
    token = hold()
    watch(watcher)

    def stop() -> None:
        unwatch(watcher)
        release(token)

    return stop


@contextlib.contextmanager
def unpatched(archs: Archs = None) -> Iterator[Status]:
    """Stock transformers in this thread inside the block (every adapter, or the named ones): the
    patched forward calls the original at once. Nothing global changes: other threads keep what they
    had, and on exit this thread's previous choice is back. For comparing with stock (``verify``, the
    doctor and the tests use it). Compiled code follows it too (a graph traced inside the block is
    stock's).

    >>> with hfpatch.unpatched(["gpt2"]):   # doctest: +SKIP
    ...     stock_logits = model(input_ids, attention_mask=mask).logits
    """
    previous = open_block(dict.fromkeys(select(archs), False))
    try:
        yield status()
    finally:
        close_block(previous)


def status() -> Status:
    """Every model type hfpatch knows: its state and, where it is not patched, why."""
    with _lock:
        version = installed_transformers()
        entries = table(_registry, _states, _undeclared, _left_alone, version)
        pinned = any(state.pin.pinned for state in _states.values())
        how = "; ".join(_applied_by) or ("hfpatch.apply() in this program" if pinned else "")
        unpadded = {"on": UNPAD[0], **UNPADDED}
    entries += new_types(version, [entry.arch for entry in entries])  # (an import: outside the lock)
    return Status(str(version) if version else None, entries, how, SHADOW_COUNTS, unpadded)


def applied_by(how: str) -> None:
    """Record how hfpatch was applied in this process (``hfpatch.auto`` and the launcher say so)."""
    with _lock:
        _applied_by.append(how)


def select(archs: Archs) -> list[str]:
    """Adapter names for ``archs`` (model types; an alias selects its adapter); ``None``: every one.
    ``TypeError`` for anything but a string or an iterable of them, ``ValueError`` for none, or for a
    model type hfpatch does not patch, with the reason or the nearest names."""
    if archs is None:
        return list(_registry)
    if isinstance(archs, str):
        names = [archs]
    elif isinstance(archs, Iterable) and not isinstance(archs, (bytes, Mapping)):
        names = list(archs)
    else:
        raise TypeError(f"archs: expected a model type, a list of them, or None; got {type(archs).__name__}")
    if not all(isinstance(n, str) for n in names):
        raise TypeError(f"archs: expected model types (strings), got {archs!r}")
    if not names:
        raise ValueError("archs: an empty list names no model type (None means every one)")
    not_patched = [
        f"{n} ({_undeclared[n].verdict}: {_undeclared[n].reason})" for n in names if n in _undeclared
    ]
    if not_patched:
        raise ValueError(f"archs: hfpatch does not patch {'; '.join(not_patched)}")
    unknown = [n for n in names if n not in _registry and n not in _aliases]
    if unknown:
        known = [*_registry, *_aliases, *_undeclared]
        hints = [f"{n!r}{nearest(n, known)}" for n in unknown]
        raise ValueError(f"archs: unknown model type {', '.join(hints)}; hfpatch.status() lists every one")
    return list(dict.fromkeys(_aliases.get(n, n) for n in names))


def _hook(name: str) -> Callable[[Any], None]:
    def on_import(module: Any) -> None:
        with _lock:
            state = _states[name]
            if state.wanted and not state.installed:
                rebind_hooked(_install(state, module))

    return on_import


def _install(state: AdapterState, module: Any) -> list[Patch]:
    """Patch ``state``'s adapter in ``module``, or record why not (and stop wanting it). Never raises.
    The rows are built the first time and reused, unless a class changed since (then built again)."""
    if state.installed:
        return []
    if not state.rows or _ledger.stale(state.rows):
        from .build import build  # imports torch: only now, when transformers has loaded it anyway

        try:
            state.rows = _ledger.shared(build(state.adapter, module, state.pin))
        except TypeError as exc:
            state.skip_reason, state.class_differs = str(exc), True
            state.pin.pinned = state.forced = False
            state.holders.clear()
            return []
    state.class_differs = False
    state.installed = True
    state.skip_reason = None
    if any(row.late for row in state.rows):
        state.pin.late = functools.partial(_install_late, state)
    return _ledger.install(state.pin, state.rows)


def _install_late(state: AdapterState) -> None:
    """Install the rows of ``state``'s adapter that only a packed call needs (its module's attention
    functions by sequence: until then a call pays nothing for them), at its first packed call."""
    with _lock:
        if state.installed and state.pin.late is not None:
            _ledger.install(state.pin, state.rows, late=True)
        state.pin.late = None


# --- classes outside transformers (hfpatch.custom) ----------------------------------------------------


def discover() -> None:
    """Look at the subclasses of ``PreTrainedModel`` defined outside transformers since the last look
    (``apply()``, ``patched()`` and ``verify()`` call it): a recognised one gets an adapter of its own,
    checked on a tiny copy when something first wants it."""
    with _lock:
        _discover()


def custom_adapter(cls: type) -> Optional[Adapter]:
    """The adapter hfpatch made for ``cls``, a class outside transformers, or None."""
    with _lock:
        return next((state.adapter for state in _states.values() if state.owner is cls), None)


def _discover() -> None:
    for cls in _WATCH.unseen():
        _notice(cls)


def _notice(cls: type) -> Optional[str]:
    """Register ``cls`` if it is recognised (its model type), or record why it is left alone."""
    taken = {*_registry, *_aliases, *_undeclared, *_left_alone}
    found = custom.recognise(cls, taken)
    if found is None:
        return None
    if found.adapter is None:
        _left_alone[found.arch] = found.reason
        return None
    _registry[found.arch] = found.adapter
    _states[found.arch] = AdapterState(found.adapter, owner=cls)
    return found.arch


def _checked(state: AdapterState) -> bool:
    """Whether a custom class passed its check on a tiny copy (:func:`_check_classes` ran it); while it
    runs, its own ``verify`` in the checking thread installs the rows for that thread's blocks."""
    return state.checked is True or custom.CHECKS.checking_here(state.owner)


def _first_call(name: str) -> None:
    """The first eager call of a custom class defined while ``apply()`` holds: its check (outside the
    lock), then the pin where it passes; where it does not, the class is stock again. A call inside the
    check itself (its tiny copy's) or while its module still imports changes nothing yet."""
    state = _states[name]
    _check_classes([name])
    with _lock:
        if state.checked is None or state.pin.awaiting is None:
            return
        state.pin.awaiting = None
        if state.checked and _WATCH.pin.pinned:
            _want([name], holder=None)
        elif not state.checked:
            state.skip_reason = state.check_reason
            if not state.holders:
                _uninstall(state)


def _check_classes(names: list[str]) -> None:
    """The check on a tiny copy of each custom class among ``names`` not checked yet
    (:data:`hfpatch.custom.CHECKS`), run outside the engine's lock. Called without it held."""
    with _lock:
        owners = [_states[name].owner for name in names if _states[name].owner is not None]
    custom.CHECKS.run(owners)


def _on_new_class(cls: type) -> None:
    """A subclass of ``PreTrainedModel`` outside transformers was just defined while ``apply()`` holds
    (:class:`hfpatch.custom.Watch`): a recognised one is installed unpinned, checked at its first call."""
    name = _notice(cls)
    if name is not None:
        rebind_hooked(_want([name], holder=None, at_first_call=True))


_WATCH = custom.Watch(_ledger, _lock, _on_new_class)


def _uninstall(state: AdapterState) -> None:
    """Undo ``state``'s rows (a row shared with another installed adapter stays; one someone replaced
    after us stays theirs)."""
    if state.installed:
        state.pin.late = None
        _ledger.revert(state.pin, state.rows)
        state.installed = False
