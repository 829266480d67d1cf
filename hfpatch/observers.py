"""The observers of patched calls, in one room: their registry (:func:`watch`, :func:`unwatch`), the
record of one call each of them reads (:class:`Seen`), the one place a call runs through them
(:func:`run_watched`), where a call came from (:func:`call_site`), how a cache is known again after a
copy (:func:`fingerprint`), and the counters ``status()`` reports (:data:`SHADOW_COUNTS`).

Its subscribers are the audit (:mod:`hfpatch.judge`, which :mod:`hfpatch.auditing` starts) and the
shadow (:mod:`hfpatch.shadowing`). While one is registered no pin is fast, and the patched forward
(:mod:`hfpatch.forward`) hands the outermost eager call in each thread here (``CALL.watching`` is set
inside, so nested calls and an observer's own work are not watched again). Imports no torch.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

from ._context import CALL, hold_slow_path, release_slow_path

__all__ = [
    "SHADOW_COUNTS",
    "WATCHERS",
    "Seen",
    "call_site",
    "fingerprint",
    "keys_fingerprint",
    "run_watched",
    "unwatch",
    "watch",
]

# the observers of every patched forward's calls, outermost first: each is called as
# ``watcher(seen, call)`` and returns ``call()``; a tuple, replaced whole (a call reads it without a lock)
WATCHERS: list[tuple[Callable, ...]] = [()]
# this process's hfpatch.shadow checks, and the calls it let go, by reason
SHADOW_COUNTS: dict[str, Any] = {"checked": 0, "mismatches": 0, "worst": 0.0, "skipped": {}}
_LOCK = threading.Lock()


def watch(watcher: Callable) -> None:
    """Register a process-wide observer of patched forwards' calls (no pin is fast while it is)."""
    with _LOCK:
        hold_slow_path()  # first: a call that sees the observer never takes the fast path
        WATCHERS[0] = (*WATCHERS[0], watcher)


def unwatch(watcher: Callable) -> None:
    """Remove an observer :func:`watch` registered."""
    with _LOCK:
        if watcher not in WATCHERS[0]:
            return
        WATCHERS[0] = tuple(w for w in WATCHERS[0] if w is not watcher)
        release_slow_path()


class Seen(NamedTuple):
    """One call of a patched class's forward, as its observers read it: nothing in it may be changed."""

    model: Any
    adapter: Any  # its hfpatch.declarations.Adapter
    kwargs: dict  # the call's arguments by name (positional ones bound): a copy of the caller's dict
    cache: Any  # the cache passed, under either name, or None
    patched: bool  # whether this call runs hfpatch's patch (apply(), or a patched() block here)
    ids_rank: int  # the rank of its input_ids (3: audio codes)


def run_watched(
    model: Any, adapter: Any, named: dict, patched: bool, ids_rank: int, call: Callable[[], Any]
) -> Any:
    """Run ``call`` (the forward's own) through the registered observers, each of which returns the
    result of the call it is handed: what it computes is the forward's own. What they read of it is the
    record made here (:class:`Seen`) from the call's arguments by name (``named``: a copy, positional
    ones bound), whether it runs the patch, and its ``input_ids``' rank."""
    from ._compat import CACHE_NAMES  # (torch: loaded by any model call)

    cache = next((named[name] for name in CACHE_NAMES if named.get(name) is not None), None)
    seen = Seen(model, adapter, named, cache, patched, ids_rank)
    CALL.watching = True
    try:
        for watcher in reversed(WATCHERS[0]):
            call = functools.partial(watcher, seen, call)
        return call()
    finally:
        CALL.watching = False


def fingerprint(cache: Any) -> Any:
    """A cache's length and its first layer's newest keys, summed: a deep copy has the same."""
    from .caches import first_layer_keys, past_length  # (torch: loaded by any call that has a cache)

    keys = first_layer_keys(cache)
    if keys is None:
        return None
    return past_length(cache), keys_fingerprint(keys)


def keys_fingerprint(keys: Any) -> float:
    """The newest slot of a layer's keys, summed (a sliding layer keeps fewer slots than the cache)."""
    return float(keys[..., -1, :].double().sum())


INTERNAL = ("transformers", "torch", "hfpatch")  # frames skipped to find a call site


def call_site() -> tuple[str, Any]:
    """``file:line`` of the first frame outside transformers, torch and hfpatch (relative to the working
    directory where it lies under it), and the frame (None where there is none)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] in INTERNAL:
        frame = frame.f_back
    if frame is None:
        return "?", None
    path = frame.f_code.co_filename
    shown = _SHOWN.get(path)
    if shown is None:
        shown = path
        with contextlib.suppress(ValueError):
            relative = os.path.relpath(path)
            shown = path if relative.startswith("..") else relative
        _SHOWN[path] = shown
    return f"{shown}:{frame.f_lineno}", frame


_SHOWN: dict[str, str] = {}  # a file's path as a call site shows it (the working directory of its first call)
