"""What a call reads, in one place: this thread's choice of patched or stock, the positions handed to a
position module, the SDPA switch. A leaf: it imports nothing of hfpatch (nor torch), and every module
that runs inside a call reads it from here.

- :data:`CALL` is per thread (``threading.local``): ``patched()``/``unpatched()`` set ``overrides``;
  a patched forward sets ``pending`` (:mod:`hfpatch.decoders`) and ``eager_mask``
  (:class:`SdpaSwitch`) for the duration of its original call.
- :class:`Pin`: per adapter, whether ``apply()`` holds it process-wide (read by its patched forward).
- :data:`PACKED`: process-wide, whether a row whose positions restart is kept to the sequences it packs
  (``apply(packed=False)``, ``HFPATCH_PACKED=0``: left to stock); :data:`UNPAD`, whether a padded call
  runs on its real tokens (``apply(unpad=True)``, ``HFPATCH_UNPAD=1``: :mod:`hfpatch.unpad`).
- ``CALL.watching``: inside a watched call (:mod:`hfpatch.observers`, which also holds the slow path
  while an observer is registered: :func:`hold_slow_path`).
- :class:`CarryContext`: activation checkpointing recomputes a layer in the backward pass, after the
  call that set the context has returned; the checkpoint function of a patched module carries the
  context of the forward call into that recomputation, so that the layer reads the same.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any, Optional

__all__ = [
    "CALL",
    "PACKED",
    "PACKED_VARIABLE",
    "UNPAD",
    "UNPADDED",
    "UNPAD_VARIABLE",
    "CarryContext",
    "Pin",
    "SdpaSwitch",
    "Users",
    "close_block",
    "count_unpadded",
    "open_block",
    "hold_slow_path",
    "patched_here",
    "read_packed",
    "read_unpad",
    "release_slow_path",
]


class _Call(threading.local):
    """The calling thread's context (class attributes are every new thread's defaults)."""

    overrides: Optional[dict[str, bool]] = None  # adapter -> patched here?, set by patched()/unpatched()
    eager_mask: bool = False  # see SdpaSwitch
    pending: Any = None  # positions waiting for their position module (hfpatch.decoders.Pending)
    generated: Any = None  # (the 4-D mask generate() just made, the 2-D mask it made it from)
    handed: Any = None  # a packed row's positions a task head drops, for its base model (hfpatch.packed)
    handed_mask: Any = None  # the mask a task head drops, for its base model without attention (RWKV's)
    laid: Any = None  # an unpadded call's packed row as laid out (hfpatch.layout.Layout), for its packed call
    # hfpatch.unpad: False inside a task head whose labels a pad would predict (its base model is not
    # unpadded); True inside the packed call an unpadded one makes
    unpad: Optional[bool] = None
    unpadding: bool = False
    ran_unpadded: int = 0  # the calls this thread ran on their real tokens (a task head reads its base's)
    generating: Any = None  # the 2-D mask generate() is about to pass (apply(unpad=True): its last column)
    mixing: Any = None  # the call's sequences, for its layers that carry a state (hfpatch.mixers.Runs)
    watching: bool = False  # inside a watched call, or a watcher's own work: not watched again


CALL = _Call()


class Pin:
    """Whether ``apply()`` holds an adapter for the whole process (until ``revert()``), and ``fast``: it
    is pinned and no thread has a ``patched()``/``unpatched()`` block open (then a call needs no look at
    its thread's choice: the check every eager call makes first)."""

    __slots__ = ("arch", "_pinned", "fast", "awaiting", "late")

    def __init__(self, arch: str) -> None:
        self.arch = arch
        self._pinned = False
        self.fast = False
        # a class outside transformers defined while apply() holds: what its first eager call runs (its
        # check on a tiny copy, then the pin), None once it has run
        self.awaiting: Optional[Callable[[], None]] = None
        # what installs the adapter's rows only a packed call needs (hfpatch.attention's), at the first
        # such call; None when it has none, or they are in
        self.late: Optional[Callable[[], None]] = None
        _PINS.append(self)

    @property
    def pinned(self) -> bool:
        return self._pinned

    @pinned.setter
    def pinned(self, value: bool) -> None:
        with _BLOCKS_LOCK:
            self._pinned = value
            self.fast = value and not _blocks[0]


_PINS: list[Pin] = []
_BLOCKS_LOCK = threading.Lock()
_blocks = [0]  # patched()/unpatched() blocks open, in every thread


def open_block(overrides: dict[str, bool]) -> Optional[dict[str, bool]]:
    """Enter a ``patched()``/``unpatched()`` block in this thread: its choices over the thread's own,
    which are returned (for :func:`close_block`). No pin is fast while any block is open."""
    with _BLOCKS_LOCK:
        _blocks[0] += 1
        if _blocks[0] == 1:
            for pin in _PINS:
                pin.fast = False
    previous = CALL.overrides
    CALL.overrides = {**(previous or {}), **overrides}
    return previous


def close_block(previous: Optional[dict[str, bool]]) -> None:
    """Leave the block :func:`open_block` entered: the thread's previous choices are back."""
    CALL.overrides = previous
    with _BLOCKS_LOCK:
        _blocks[0] -= 1
        if not _blocks[0]:
            for pin in _PINS:
                pin.fast = pin._pinned


WARNED: set[tuple[str, ...]] = set()  # the keys of the warnings given once in this process


def warn_once(key: tuple[str, ...], message: str, stacklevel: int) -> None:
    """A ``RuntimeWarning`` the first time ``key`` is seen in this process (``stacklevel`` as the caller
    would give ``warnings.warn``)."""
    if key in WARNED:
        return
    WARNED.add(key)
    warnings.warn(message, RuntimeWarning, stacklevel=stacklevel + 1)


PACKED = [True]  # packed rows kept to their sequences (apply(packed=...)); a list, read at each call
PACKED_VARIABLE = "HFPATCH_PACKED"  # 0: packed rows left to stock, as apply(packed=False), wherever applied


UNPAD = [False]  # padded calls run on their real tokens (apply(unpad=True)); read at each call
UNPAD_VARIABLE = "HFPATCH_UNPAD"  # 1: as apply(unpad=True), wherever applied
# the calls hfpatch.unpad ran on their real tokens, and those it left padded, by reason (status())
UNPADDED: dict[str, Any] = {"calls": 0, "padded": {}}
_COUNTING = threading.Lock()


def count_unpadded(why: Optional[str]) -> None:
    """One call run on its real tokens (``why`` None), or kept padded for ``why``."""
    with _COUNTING:
        if why is None:
            UNPADDED["calls"] = UNPADDED["calls"] + 1
        else:
            UNPADDED["padded"][why] = UNPADDED["padded"].get(why, 0) + 1


def read_packed(environ: Any) -> Optional[bool]:
    """``HFPATCH_PACKED``: False (0, false, no, off), True (1, true, yes, on) or None (unset); anything
    else is a ``ValueError`` naming the variable."""
    return _switch(environ, PACKED_VARIABLE)


def read_unpad(environ: Any) -> Optional[bool]:
    """``HFPATCH_UNPAD``, read as :func:`read_packed` reads its variable."""
    return _switch(environ, UNPAD_VARIABLE)


def _switch(environ: Any, name: str) -> Optional[bool]:
    value = environ.get(name, "").strip().lower()
    if not value:
        return None
    if value not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        raise ValueError(f"{name}={environ[name]}: expected 0 or 1")
    return value in ("1", "true", "yes", "on")


def hold_slow_path() -> None:
    """One more reason no pin may be fast (an observer registered: :mod:`hfpatch.observers`)."""
    with _BLOCKS_LOCK:
        _blocks[0] += 1
        for pin in _PINS:
            pin.fast = False


def release_slow_path() -> None:
    """Undo one :func:`hold_slow_path`."""
    with _BLOCKS_LOCK:
        _blocks[0] -= 1
        if not _blocks[0]:
            for pin in _PINS:
                pin.fast = pin._pinned


def patched_here(pin: Pin) -> bool:
    """Whether an eager call in this thread gets the adapter's patch: this thread's ``patched()`` /
    ``unpatched()`` choice, else ``apply()``'s."""
    overrides = CALL.overrides
    return pin._pinned if overrides is None else overrides.get(pin.arch, pin._pinned)


class Users:
    """The adapters that share one installed replacement (a rotary class of their module): a tuple,
    replaced whole under the engine's lock, so that a call reads it without taking the lock."""

    __slots__ = ("pins",)

    def __init__(self) -> None:
        self.pins: tuple[Pin, ...] = ()

    def any_patched_here(self) -> bool:
        return any(patched_here(pin) for pin in self.pins)


class SdpaSwitch:
    """Installed as a base-model class's boolean attribute (``Adapter.eager_mask``: ``_use_sdpa``,
    4.36-4.37) while the class is patched. Instances keep their own value; it reads False in a thread
    whose current call asked for transformers' eager 4-D mask, so that no instance is ever changed."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        if instance is None:
            return self
        return False if CALL.eager_mask else instance.__dict__.get(self.name, False)

    def __set__(self, instance: Any, value: Any) -> None:
        instance.__dict__[self.name] = value


class CarryContext:
    """Installed as ``_gradient_checkpointing_func`` on the classes of a patched module that checkpoint
    their layers (transformers sets the function on each instance): reading it gives the instance's own
    function, wrapped so that what it checkpoints runs, when recomputed in the backward pass, with the
    context this thread had when the forward call checkpointed it."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        if instance is None:
            return self
        try:
            checkpoint = instance.__dict__[self.name]
        except KeyError:
            raise AttributeError(self.name) from None
        return _Carrying(checkpoint)

    def __set__(self, instance: Any, value: Any) -> None:
        instance.__dict__[self.name] = value


class _Carrying:
    """A checkpoint function whose checkpointed function sees this call's context when recomputed."""

    __slots__ = ("checkpoint",)

    def __init__(self, checkpoint: Callable) -> None:
        self.checkpoint = checkpoint

    def __call__(self, function: Callable, *args: Any, **kwargs: Any) -> Any:
        saved = (CALL.overrides, CALL.eager_mask, CALL.pending, CALL.mixing)
        if saved == (None, False, None, None):  # nothing to carry: the function as it is
            return self.checkpoint(function, *args, **kwargs)
        return self.checkpoint(_WithContext(function, saved), *args, **kwargs)


class _WithContext:
    __slots__ = ("function", "saved")

    def __init__(self, function: Callable, saved: tuple) -> None:
        self.function, self.saved = function, saved

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        overrides, eager_mask, pending, mixing = self.saved
        before = (CALL.eager_mask, CALL.pending, CALL.mixing)
        previous = open_block(overrides) if overrides is not None else None
        CALL.eager_mask, CALL.pending, CALL.mixing = eager_mask, pending, mixing
        try:
            return self.function(*args, **kwargs)
        finally:
            CALL.eager_mask, CALL.pending, CALL.mixing = before
            if overrides is not None:
                close_block(previous)
