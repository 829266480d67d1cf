"""The patching engine: one registry, one lock, and the same install / revert / report for every adapter.

An adapter's patch is installed when something wants it (``apply()``, or a ``patched()`` block still
open in some thread), its release range admits the installed transformers, and its module has been
imported: at once if it already was, otherwise from a wrapt post-import hook when the user imports
it. ``apply()`` itself imports no ``transformers.models`` module. The class's own ``forward`` is
replaced, so models built earlier are fixed too.

Who gets the patched result: ``apply()`` pins an adapter for the whole process (until
``revert()``). ``patched()`` and ``unpatched()`` blocks decide for their own thread only (like
``torch.no_grad()``): the installed forward reads this thread's choice (:data:`THREADS`) at each eager
call, so a block in one thread never changes what another thread computes. Compiled code is traced
once and follows the installed patch.
"""

import contextlib
import difflib
import sys
import threading
import types
import warnings
from collections.abc import Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import Any, Callable, NamedTuple, Optional, Union

from .declarations import Adapter, Undeclared
from .plans import read_plan
from .support import NEWEST_TESTED, OUTSIDE, UNTESTED_NEWER, in_range, installed_transformers, support

__all__ = [
    "THREADS",
    "AdapterStatus",
    "Status",
    "apply",
    "declare_all",
    "patched",
    "register_all",
    "registry",
    "revert",
    "select",
    "status",
    "unpatched",
]

APPLIED = "applied"
WAITING = "waiting for import"
SKIPPED = "skipped"
NOT_APPLIED = "not applied"

Archs = Union[str, Iterable[str], None]


class _State:
    __slots__ = (
        "name", "pinned", "holders", "hooked", "owner", "original", "patch", "skip_reason", "switch",
        "companions",
    )  # fmt: skip

    def __init__(self, name: str) -> None:
        self.name = name  # the adapter's model type
        self.pinned = False  # apply() asked for it (until revert()); the patched forward reads it
        self.holders: set[object] = set()  # tokens of the patched() blocks still open, in any thread
        self.hooked = False  # a post-import hook is registered for its module (wrapt keeps hooks forever)
        self.owner: Any = None  # the class patched
        self.original: Optional[Callable] = None
        self.patch: Optional[Callable] = None
        self.skip_reason: Optional[str] = None
        self.switch: Optional[tuple[str, Any]] = None  # (name, the class attribute it replaced): SdpaSwitch
        # other classes patched with it (Adapter.also, Adapter.receiver): (class, attribute, original, patch)
        self.companions: list[tuple[type, str, Callable, Callable]] = []

    @property
    def wanted(self) -> bool:
        return self.pinned or bool(self.holders)


class _Threads(threading.local):
    """What the calling thread chose (class attributes are every new thread's defaults)."""

    overrides: Optional[dict[str, bool]] = None  # adapter -> patched here?, set by patched()/unpatched()
    eager_mask: bool = False  # see SdpaSwitch


THREADS = _Threads()


class SdpaSwitch:
    """Installed as a base-model class's boolean attribute (``Adapter.eager_mask``: ``_use_sdpa``,
    4.36-4.37) while the class is patched. Instances keep their own value; it reads False in a thread
    whose current call asked for transformers' eager 4-D mask, so that no instance is ever changed."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        if instance is None:
            return self
        return False if THREADS.eager_mask else instance.__dict__.get(self.name, False)

    def __set__(self, instance: Any, value: Any) -> None:
        instance.__dict__[self.name] = value


_lock = threading.RLock()
_registry: dict[str, Adapter] = {}
_undeclared: dict[str, Undeclared] = {}
_aliases: dict[str, str] = {}  # model type -> the adapter that patches its class
_states: dict[str, _State] = {}
_warned: set[str] = set()  # warnings already given in this process
_open_blocks: set[object] = set()  # tokens of the patched() blocks not exited yet
_swapped: dict[Callable, Callable] = {}  # forward functions just replaced on a class: old -> new
_applied_by: list[str] = []  # how apply() was called in this process, when not by the user's code
# rotary classes of a patched module whose rope scaling hfpatch makes per row (hfpatch.rope), by module:
# (the adapters installed in it, the (class, original forward) pairs); undone with its last adapter
_rotary: dict[str, tuple[set[str], list[tuple[type, Callable]]]] = {}


class AdapterStatus(NamedTuple):
    """One model type: its ``state`` (``applied``, ``waiting for import``, ``skipped``, ``not applied``;
    or, for model types hfpatch does not patch, ``right on stock``, ``not fixable by positions``,
    ``not covered``), why, the ``target`` and ``versions`` of the adapter that patches it, and its
    ``support`` on the installed release (``tested``, ``untested newer``, ``known-bad``, ``outside``;
    empty for model types without an adapter)."""

    arch: str
    target: str
    versions: str
    state: str
    reason: str
    support: str


class Status(Mapping):
    """What ``hfpatch.status()`` returns: a read-only mapping from model type to its
    :class:`AdapterStatus` (``status()["qwen2"].state``, ``"mamba" in status()``), plus the installed
    ``transformers`` release. ``print()`` it for a table."""

    __slots__ = ("transformers", "applied_by", "_entries")  # not a dataclass: ~1 ms at import

    def __init__(
        self, transformers: Optional[str], entries: tuple[AdapterStatus, ...], applied_by: str = ""
    ) -> None:
        self.transformers = transformers
        self.applied_by = applied_by  # "import hfpatch.auto", the launcher, or "" (the code's own apply())
        self._entries = {entry.arch: entry for entry in entries}

    @property
    def adapters(self) -> tuple[AdapterStatus, ...]:
        """Every entry, in registry order."""
        return tuple(self._entries.values())

    def __getitem__(self, arch: str) -> AdapterStatus:
        try:
            return self._entries[arch]
        except (KeyError, TypeError):
            raise KeyError(f"no model type {arch!r}; known: {', '.join(self._entries)}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Status):
            return NotImplemented
        return (self.transformers, self.adapters) == (other.transformers, other.adapters)

    def __repr__(self) -> str:
        return f"Status(transformers={self.transformers!r}, adapters={self.adapters!r})"

    def __str__(self) -> str:
        rows = [("arch", "state", "support", "target", "reason")]
        rows += [(a.arch, a.state, a.support, a.target, a.reason) for a in self.adapters]
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        lines = [f"transformers {self.transformers or 'not installed'}"]
        if self.applied_by:
            lines.append(f"applied by {self.applied_by}")
        lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[4] for row in rows]
        lines.append("Patch before torch.compile, or call torch._dynamo.reset() after apply()/revert().")
        return "\n".join(line.rstrip() for line in lines)


def register_all(*adapters: Adapter) -> tuple[Adapter, ...]:
    """Add adapters to the registry (the declaration modules call this at import)."""
    with _lock:
        for adapter in adapters:
            for name in (adapter.arch, *adapter.aliases):
                if name in _registry or name in _aliases or name in _undeclared:
                    raise ValueError(f"model type {name!r} is declared twice")
            _registry[adapter.arch] = adapter
            _states[adapter.arch] = _State(adapter.arch)
            _aliases.update((alias, adapter.arch) for alias in adapter.aliases)
    return adapters


def declare_all(*entries: Undeclared) -> tuple[Undeclared, ...]:
    """Add model types that hfpatch knows and does not patch (listed by ``status()``)."""
    with _lock:
        for entry in entries:
            if entry.arch in _registry or entry.arch in _aliases or entry.arch in _undeclared:
                raise ValueError(f"model type {entry.arch!r} is declared twice")
            _undeclared[entry.arch] = entry
    return entries


def registry() -> Mapping[str, Adapter]:
    """A read-only view of every adapter, by architecture (``config.model_type``), in registry order.

    >>> hfpatch.registry()["llama"].cls
    'LlamaModel'
    """
    return MappingProxyType(_registry)


def adapter_for(arch: str) -> Optional[Adapter]:
    """The adapter that patches ``arch``'s class (``arch`` may be an alias, like ``exaone``), or None."""
    return _registry.get(_aliases.get(arch, arch))


def apply(archs: Archs = None) -> Status:
    """Patch every registered adapter (or the named model types) whose release range admits the
    installed transformers. Idempotent and thread-safe; never raises because of the installed release.

    >>> import hfpatch
    >>> hfpatch.apply()                # doctest: +SKIP
    >>> hfpatch.apply(["qwen2"])       # doctest: +SKIP
    """
    with _lock:
        _want(select(archs), holder=None)
        _rebind_hooked()
        return status()


def _want(names: list[str], holder: Optional[object]) -> None:
    version = installed_transformers()
    refused, untested = [], []
    for name in names:
        adapter, state = _registry[name], _states[name]
        verdict = support(adapter, version)
        if not verdict.patchable:
            state.skip_reason = verdict.reason
            refused.append(verdict.reason)
            continue
        if verdict.level == UNTESTED_NEWER:
            untested.append(name)
        if holder is None:
            state.pinned = True
        else:
            state.holders.add(holder)
        state.skip_reason = None
        module = sys.modules.get(adapter.module)
        if module is not None:
            _install(adapter, state, module)
        elif not state.hooked:
            import wrapt  # about 8 ms, so only when a module must be waited for

            wrapt.register_post_import_hook(_hook(name), adapter.module)
            state.hooked = True
    if refused and len(refused) == len(names):
        reasons = "; ".join(dict.fromkeys(refused))
        _warn_once("nothing", f"hfpatch patches nothing for transformers {version}: {reasons}")
    if untested:
        _warn_once(
            "untested",
            f"hfpatch is not tested with transformers {version} (newest tested: {NEWEST_TESTED}); "
            f"patching {', '.join(untested)} because the signatures match. hfpatch.status() says more.",
        )


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=4)


def revert(archs: Archs = None) -> Status:
    """Restore the exact original ``forward`` function objects of every adapter (or the named ones),
    whoever applied them."""
    with _lock:
        _unwant(select(archs))
        _rebind_hooked()
        return status()


def _unwant(names: list[str]) -> None:
    """Nothing pins or holds these adapters any more, and their patches are gone."""
    for name in names:
        state = _states[name]
        state.pinned = False
        state.holders.clear()
        _uninstall(state)


@contextlib.contextmanager
def patched(archs: Archs = None) -> Iterator[Status]:
    """Patched results in this thread inside the block (every adapter, or the named ones), whatever
    ``apply()`` says; other threads are not affected. On exit the thread's previous choice is back, and
    a patch installed only for this block is removed. Blocks nest; ``revert()`` inside one wins.

    >>> with hfpatch.patched():        # doctest: +SKIP
    ...     logits = model(input_ids, attention_mask=mask).logits
    """
    token = object()
    with _lock:
        names = select(archs)
        _want(names, holder=token)
        _rebind_hooked()
    previous = THREADS.overrides
    THREADS.overrides = {**(previous or {}), **dict.fromkeys(names, True)}
    try:
        yield status()
    finally:
        THREADS.overrides = previous
        with _lock:
            for name in names:
                state = _states[name]
                state.holders.discard(token)
                if not state.wanted:
                    _uninstall(state)
            _rebind_hooked()


@contextlib.contextmanager
def unpatched(archs: Archs = None) -> Iterator[Status]:
    """Stock transformers in this thread inside the block (every adapter, or the named ones): the
    patched forward calls the original at once. Nothing global changes: other threads keep what they
    had, and on exit this thread's previous choice is back. For comparing with stock (``verify``, the
    doctor and the tests use it). Compiled code is traced once and does not follow it.

    >>> with hfpatch.unpatched(["gpt2"]):   # doctest: +SKIP
    ...     stock_logits = model(input_ids, attention_mask=mask).logits
    """
    names = select(archs)
    previous = THREADS.overrides
    THREADS.overrides = {**(previous or {}), **dict.fromkeys(names, False)}
    try:
        yield status()
    finally:
        THREADS.overrides = previous


def status() -> Status:
    """Every model type hfpatch knows: its state and, where it is not patched, why."""
    with _lock:
        version = installed_transformers()
        entries = []
        for name, adapter in _registry.items():
            entry = _adapter_status(name, adapter, version)
            entries.append(entry)
            since = dict(adapter.alias_since)
            for alias in adapter.aliases:
                reason = f"runs {adapter.cls}, patched by the {name!r} adapter; {entry.reason}"
                alias_entry = entry._replace(arch=alias, reason=reason)
                if alias in since and version is not None and not in_range(f">={since[alias]}", version):
                    reason += (
                        f"; {alias} itself is verified from {since[alias]} only (its tiny model builds there)"
                    )
                    alias_entry = alias_entry._replace(reason=reason, support=OUTSIDE)
                entries.append(alias_entry)
        entries += [AdapterStatus(u.arch, "", "", u.verdict, u.reason, "") for u in _undeclared.values()]
        return Status(str(version) if version else None, tuple(entries), "; ".join(_applied_by))


def applied_by(how: str) -> None:
    """Record how hfpatch was applied in this process (``hfpatch.auto`` and the launcher say so)."""
    with _lock:
        _applied_by.append(how)


def _adapter_status(name: str, adapter: Adapter, version: Any) -> AdapterStatus:
    state = _states[name]
    verdict = support(adapter, version)
    here = (THREADS.overrides or {}).get(name)  # this thread's patched()/unpatched() choice, if any
    if state.patch is not None and (state.pinned if here is None else here):
        entry = (APPLIED, verdict.reason)
    elif state.skip_reason is not None:
        entry = (SKIPPED, state.skip_reason)
    elif here is False:
        entry = (NOT_APPLIED, "stock in this thread: inside hfpatch.unpatched()")
    elif state.wanted and state.patch is None:
        entry = (WAITING, f"patched when {adapter.module} is imported; {verdict.reason}")
    elif state.patch is not None:
        entry = (NOT_APPLIED, "patched only inside other threads' hfpatch.patched() blocks")
    else:
        entry = (NOT_APPLIED, "hfpatch.apply() has not been called (or revert() was)")
    return AdapterStatus(name, adapter.target, adapter.versions, *entry, verdict.level)


def select(archs: Archs) -> list[str]:
    """Adapter names for ``archs`` (model types; an alias selects its adapter); ``None``: every one.
    ``ValueError`` for a model type hfpatch does not patch, with the reason or the nearest names."""
    if archs is None:
        return list(_registry)
    names = [archs] if isinstance(archs, str) else list(archs)
    if not all(isinstance(n, str) for n in names):
        raise TypeError(f"archs: expected a model type or a list of them, got {archs!r}")
    not_patched = [
        f"{n} ({_undeclared[n].verdict}: {_undeclared[n].reason})" for n in names if n in _undeclared
    ]
    if not_patched:
        raise ValueError(f"archs: hfpatch does not patch {'; '.join(not_patched)}")
    unknown = [n for n in names if n not in _registry and n not in _aliases]
    if unknown:
        known = [*_registry, *_aliases, *_undeclared]
        hints = [
            f"{n!r}" + (f" (did you mean {' or '.join(close)}?)" if close else "")
            for n in unknown
            for close in [difflib.get_close_matches(n, known, n=3)]
        ]
        raise ValueError(f"archs: unknown model type {', '.join(hints)}; hfpatch.status() lists every one")
    return list(dict.fromkeys(_aliases.get(n, n) for n in names))


def _hook(name: str) -> Callable[[Any], None]:
    def on_import(module: Any) -> None:
        with _lock:
            state = _states[name]
            if state.wanted and state.patch is None:
                _install(_registry[name], state, module)

    return on_import


def _install(adapter: Adapter, state: _State, module: Any) -> None:
    """Patch ``adapter``'s class in ``module``, or record why not (and stop wanting it). Never raises."""
    if state.patch is not None:
        return
    owner = getattr(module, adapter.cls, None)
    original = getattr(owner, "__dict__", {}).get("forward")
    reason = None
    if owner is None or original is None:
        reason = f"{adapter.target} not found in this transformers release"
    elif getattr(original, "__hfpatch_adapter__", None) is not None:
        reason = f"{adapter.target} is already an hfpatch patch (two hfpatch copies imported?)"
    else:
        try:
            plan = read_plan(adapter, original, owner)
            companions = _companions(adapter, state, module)
        except TypeError as exc:
            reason = str(exc)
    if reason is not None:
        state.skip_reason = reason
        state.pinned = False
        state.holders.clear()
        return
    from .caches import remember_requested_lengths
    from .forward import make_forward  # imports torch: only now, when transformers has loaded it anyway

    state.owner, state.original, state.patch = owner, original, make_forward(adapter, original, plan, state)
    state.skip_reason = None
    _install_rotary(module, adapter.arch)
    remember_requested_lengths(True)
    if plan.eager_mask_attr is not None:
        name = plan.eager_mask_attr
        state.switch = (name, owner.__dict__.get(name))
        type.__setattr__(owner, name, SdpaSwitch(name))
    type.__setattr__(owner, "forward", state.patch)
    _swapped[original] = state.patch
    for cls, name, before, patch in companions:
        type.__setattr__(cls, name, patch)
        if name == "forward":
            _swapped[before] = patch
    state.companions = companions


def _companions(adapter: Adapter, state: _State, module: Any) -> list[tuple[type, str, Callable, Callable]]:
    """The other classes of ``module`` patched with ``adapter`` (not installed yet): its ``also``
    classes (a seq2seq model's encoder: the same patched forward) and its ``receiver`` (the module that
    takes handed positions, :mod:`hfpatch.decoders`). ``TypeError`` saying what is missing."""
    from .decoders import patch_receiver
    from .forward import make_forward

    found = []
    for name in adapter.also:
        cls = getattr(module, name, None)
        before = getattr(cls, "__dict__", {}).get("forward")
        if before is None:
            raise TypeError(f"{module.__name__}:{name}.forward not found in this transformers release")
        plan = read_plan(adapter._replace(cls=name), before, cls)
        found.append((cls, "forward", before, make_forward(adapter._replace(cls=name), before, plan, state)))
    if adapter.receiver is not None:
        cls = getattr(module, adapter.receiver, None)
        receiver = patch_receiver(cls, adapter.family.hands_to) if isinstance(cls, type) else None
        if receiver is None:
            raise TypeError(f"{module.__name__}:{adapter.receiver} not found in this transformers release")
        found.append((cls, *receiver))
    return found


def _uninstall(state: _State) -> None:
    """Restore the original unless someone replaced our patch after us (then theirs stays)."""
    if state.patch is not None:
        if state.owner.__dict__.get("forward") is state.patch:
            type.__setattr__(state.owner, "forward", state.original)
            _swapped[state.patch] = state.original
        _uninstall_rotary(state.owner.__module__, state.name)
        for cls, name, before, patch in state.companions:
            if cls.__dict__.get(name) is patch:
                type.__setattr__(cls, name, before)
                if name == "forward":
                    _swapped[patch] = before
        state.companions = []
        if state.switch is not None:
            name, before = state.switch
            if before is None:
                type.__delattr__(state.owner, name)
            else:
                type.__setattr__(state.owner, name, before)
        state.owner = state.original = state.patch = state.switch = None
        if all(other.patch is None for other in _states.values()):
            from .caches import remember_requested_lengths

            remember_requested_lengths(False)


def _install_rotary(module: Any, arch: str) -> None:
    """Per-row rope scaling for the rotary classes of ``module`` (:mod:`hfpatch.rope`), patched once
    while an adapter of it is installed, and active in a call where one of them is."""
    from .forward import patched_here
    from .rope import patch_rotary_classes, per_row_forward

    entry = _rotary.get(module.__name__)
    if entry is not None:
        entry[0].add(arch)
        return
    users: set[str] = {arch}

    def active() -> bool:
        return any(patched_here(name, _states[name]) for name in users)

    _rotary[module.__name__] = (
        users,
        patch_rotary_classes(module, lambda f, raw: per_row_forward(f, raw, active)),
    )


def _uninstall_rotary(module_name: str, arch: str) -> None:
    entry = _rotary.get(module_name)
    if entry is None:
        return
    users, classes = entry
    users.discard(arch)
    if users:
        return
    for cls, forward in classes:
        if getattr(cls.__dict__.get("forward"), "__hfpatch_rope__", False):
            type.__setattr__(cls, "forward", forward)
    del _rotary[module_name]


HOOK_ATTRIBUTES = ("_old_forward", "forward")  # accelerate's add_hook_to_module / remove_hook_from_module


def _rebind_hooked() -> None:
    """Model instances that captured a class's ``forward`` before hfpatch changed it follow the class.

    accelerate's ``add_hook_to_module`` keeps ``module._old_forward``, a method bound to the class's
    function of that moment, and ``remove_hook_from_module`` puts it back as the instance's own
    ``forward``: a class patch alone would not reach those instances. Such bound methods are found
    with one pass over the garbage collector's objects (about 50 ms for a process with a few million
    objects), made only when ``accelerate.hooks`` has been imported: without it, nothing captures
    ``forward`` this way, and ``apply()`` stays cheap."""
    swapped = dict(_swapped)
    _swapped.clear()
    if not swapped or "accelerate.hooks" not in sys.modules:
        return
    import gc

    for obj in gc.get_objects():
        if type(obj) is types.MethodType and obj.__func__ in swapped:
            instance = obj.__self__
            attributes = getattr(instance, "__dict__", None) or {}
            for name in HOOK_ATTRIBUTES:
                if attributes.get(name) is obj:
                    attributes[name] = types.MethodType(swapped[obj.__func__], instance)
