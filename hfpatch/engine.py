"""The patching engine: one registry, one lock, and the same install / revert / report for every adapter.

An adapter is patched when ``apply()`` has asked for it, its release range admits the installed
transformers, and its module has been imported: at once if it already was, otherwise from a wrapt
post-import hook when the user imports it. ``apply()`` itself imports no ``transformers.models``
module. The class's own ``forward`` is replaced, so models built earlier are fixed too.
"""

import contextlib
import sys
import threading
import warnings
from collections.abc import Iterable, Iterator
from typing import Any, Callable, NamedTuple, Optional, Union

from .gates import NEWEST_TESTED, UNTESTED_NEWER, Adapter, installed_transformers, read_signature, support

__all__ = ["AdapterStatus", "Status", "apply", "patched", "register", "revert", "status"]

APPLIED = "applied"
WAITING = "waiting for import"
SKIPPED = "skipped"
NOT_APPLIED = "not applied"


class _State:
    __slots__ = ("wanted", "hooked", "owner", "original", "patch", "skip_reason")

    def __init__(self) -> None:
        self.wanted = False  # apply() asked for it and its gate matched
        self.hooked = False  # a post-import hook is registered for its module (wrapt keeps hooks forever)
        self.owner: Any = None  # the class patched
        self.original: Optional[Callable] = None
        self.patch: Optional[Callable] = None
        self.skip_reason: Optional[str] = None


_lock = threading.RLock()
_registry: dict[str, Adapter] = {}
_states: dict[str, _State] = {}
_warned: set[str] = set()  # warnings already given in this process


class AdapterStatus(NamedTuple):
    """One adapter: its ``state`` (``applied``, ``waiting for import``, ``skipped``, ``not applied``),
    why, and its ``support`` for the installed release (``tested``, ``untested newer``, ``known-bad``,
    ``outside``)."""

    arch: str
    target: str
    versions: str
    state: str
    reason: str
    support: str


class Status:
    """What ``hfpatch.status()`` returns: the installed transformers and every adapter's state."""

    __slots__ = ("transformers", "adapters")  # a plain class: a dataclass costs ~1 ms at import

    def __init__(self, transformers: Optional[str], adapters: tuple[AdapterStatus, ...]) -> None:
        self.transformers = transformers
        self.adapters = adapters

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Status):
            return NotImplemented
        return (self.transformers, self.adapters) == (other.transformers, other.adapters)

    def __repr__(self) -> str:
        return f"Status(transformers={self.transformers!r}, adapters={self.adapters!r})"

    def __getitem__(self, arch: str) -> AdapterStatus:
        for entry in self.adapters:
            if entry.arch == arch:
                return entry
        raise KeyError(f"no adapter {arch!r}; known: {', '.join(a.arch for a in self.adapters)}")

    def __str__(self) -> str:
        rows = [("arch", "state", "support", "target", "reason")]
        rows += [(a.arch, a.state, a.support, a.target, a.reason) for a in self.adapters]
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        lines = [f"transformers {self.transformers or 'not installed'}"]
        lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[4] for row in rows]
        lines.append("Patch before torch.compile, or call torch._dynamo.reset() after apply()/revert().")
        return "\n".join(line.rstrip() for line in lines)


def register(adapter: Adapter) -> Adapter:
    """Add an adapter to the registry (adapters call this at import)."""
    with _lock:
        if adapter.arch in _registry:
            raise ValueError(f"an adapter named {adapter.arch!r} is already registered")
        _registry[adapter.arch] = adapter
        _states[adapter.arch] = _State()
    return adapter


def apply(archs: Union[str, Iterable[str], None] = None) -> Status:
    """Patch every registered adapter (or the named ones) whose release range admits the installed
    transformers. Idempotent and thread-safe; never raises because of the installed release.

    >>> import hfpatch
    >>> hfpatch.apply()                # doctest: +SKIP
    >>> hfpatch.apply(["gpt2"])        # doctest: +SKIP
    """
    with _lock:
        names = _select(archs)
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
            state.wanted, state.skip_reason = True, None
            module = sys.modules.get(adapter.module)
            if module is not None:
                _install(adapter, state, module)
            elif not state.hooked:
                import wrapt  # about 8 ms, so only when a module must be waited for

                wrapt.register_post_import_hook(_hook(name), adapter.module)
                state.hooked = True
        if refused and len(refused) == len(names):
            _warn_once(
                "nothing", f"hfpatch patches nothing for transformers {version}: " + "; ".join(refused)
            )
        if untested:
            _warn_once(
                "untested",
                f"hfpatch is not tested with transformers {version} (newest tested: {NEWEST_TESTED}); "
                f"patching {', '.join(untested)} because the signatures match. hfpatch.status() says more.",
            )
        return status()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def revert() -> Status:
    """Restore every patched ``forward`` to the exact original function object."""
    with _lock:
        for state in _states.values():
            _revert_one(state)
        return status()


@contextlib.contextmanager
def patched(archs: Union[str, Iterable[str], None] = None) -> Iterator[Status]:
    """Apply on entry; on exit revert what this block applied (adapters applied before stay).

    >>> with hfpatch.patched():        # doctest: +SKIP
    ...     logits = model(input_ids, attention_mask=mask).logits
    """
    with _lock:
        before = {name for name, state in _states.items() if state.wanted}
        result = apply(archs)
    try:
        yield result
    finally:
        with _lock:
            for name in _select(archs):
                if name not in before:
                    _revert_one(_states[name])


def status() -> Status:
    """Every adapter's state and, for a skip, why."""
    with _lock:
        version = installed_transformers()
        entries = []
        for name, adapter in _registry.items():
            state = _states[name]
            verdict = support(adapter, version)
            if state.patch is not None:
                entry = (APPLIED, verdict.reason)
            elif state.skip_reason is not None:
                entry = (SKIPPED, state.skip_reason)
            elif state.wanted:
                entry = (WAITING, f"patched when {adapter.module} is imported; {verdict.reason}")
            else:
                entry = (NOT_APPLIED, "hfpatch.apply() has not been called (or revert() was)")
            entries.append(AdapterStatus(name, adapter.target, adapter.versions, *entry, verdict.level))
        return Status(str(version) if version else None, tuple(entries))


def _select(archs: Union[str, Iterable[str], None]) -> list[str]:
    if archs is None:
        return list(_registry)
    names = [archs] if isinstance(archs, str) else list(archs)
    if not all(isinstance(n, str) for n in names):
        raise TypeError(f"archs: expected an architecture name or a list of names, got {archs!r}")
    unknown = [n for n in names if n not in _registry]
    if unknown:
        raise ValueError(f"archs: unknown architecture(s) {unknown}; known: {', '.join(_registry)}")
    return names


def _hook(name: str) -> Callable[[Any], None]:
    def on_import(module: Any) -> None:
        with _lock:
            state = _states[name]
            if state.wanted and state.patch is None:
                _install(_registry[name], state, module)

    return on_import


def _install(adapter: Adapter, state: _State, module: Any) -> None:
    """Patch ``adapter``'s class in ``module``, or record why not. Never raises."""
    if state.patch is not None:
        return
    owner = getattr(module, adapter.cls, None)
    original = getattr(owner, "__dict__", {}).get("forward")
    if owner is None or original is None:
        state.skip_reason = f"{adapter.target} not found in this transformers release"
        state.wanted = False
        return
    if getattr(original, "__hfpatch_adapter__", None) is not None:
        state.skip_reason = f"{adapter.target} is already an hfpatch patch (two hfpatch copies imported?)"
        state.wanted = False
        return
    try:
        sig = read_signature(adapter, original)
    except TypeError as exc:
        state.skip_reason = str(exc)
        state.wanted = False
        return
    from .forward import make_forward  # imports torch: only now, when transformers has loaded it anyway

    state.owner, state.original, state.patch = owner, original, make_forward(adapter, original, sig)
    state.skip_reason = None
    type.__setattr__(owner, "forward", state.patch)


def _revert_one(state: _State) -> None:
    """Restore the original unless someone replaced our patch after us (then theirs stays)."""
    state.wanted = False
    if state.patch is not None:
        if state.owner.__dict__.get("forward") is state.patch:
            type.__setattr__(state.owner, "forward", state.original)
        state.owner = state.original = state.patch = None
