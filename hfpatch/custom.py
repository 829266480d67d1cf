"""Models that follow transformers' conventions without being its classes: registered through the Auto
classes, loaded from a checkpoint's own code (``trust_remote_code=True``), or defined in the user's
program. Most are copies of a transformers modeling file with its default ``arange`` positions.

A class is **recognised** from its signature and code, never its name: a subclass of
``PreTrainedModel`` defined outside transformers whose own ``forward`` takes ``input_ids`` (or
``inputs_embeds``), ``attention_mask``, a cache (``past_key_values`` or ``cache``) and ``position_ids``,
and computes positions itself when none are given (its code compares ``position_ids`` with ``None``).
A wrapper that only hands ``position_ids`` on (a ``...ForCausalLM``) is not listed: its base model is. A
decoder of that shape without ``position_ids`` is listed and left alone.

Before a recognised class is patched it is **checked once**, on a tiny copy built from its config
class's defaults (:mod:`hfpatch.verification.classes`, which the package wires in): the
scenarios of ``verify`` (left padding, a padded cached prefix continued, holes), stock against hfpatch,
each row against itself alone. It is patched only where stock is wrong somewhere and hfpatch is exact
everywhere, so nothing becomes wrong where stock was right: positions that mean something else (2-D
positions, an offset table, a model that derives them from the mask itself) fail the check, and
``status()`` says why. The check runs in the calling thread, under its own random state (the program's
is untouched), in fp32 on the CPU, outside the engine's lock (:class:`Checks`): once per class, and a
thread that wants a class another thread is checking waits for its verdict.
"""

from __future__ import annotations

import inspect
import sys
import threading
import types
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple, Optional

from ._context import Pin
from .declarations import Adapter, Family
from .patches import ABSENT, Ledger, Patch
from .sources import fills_positions_when_none, source_of

__all__ = [
    "CHECKS",
    "CUSTOM",
    "Checks",
    "Recognised",
    "Watch",
    "check_classes_with",
    "namespace",
    "pretrained_model",
    "recognise",
]

CUSTOM = Family("custom")  # takes position_ids, as transformers' own decoders do


class Recognised(NamedTuple):
    """A class outside transformers that looks like a decoder: whether it is a candidate (``adapter``)
    or left alone (``reason``)."""

    cls: type
    arch: str  # its model type in status()
    adapter: Optional[Adapter]  # None: left alone, for ``reason``
    reason: str


def recognise(cls: type, taken: Any) -> Optional[Recognised]:
    """What ``cls`` is to hfpatch, or None where it is no decoder of its own (no ``forward`` of its own
    taking inputs, a mask and a cache) or a wrapper handing ``position_ids`` on. ``taken``: the model
    types already known (a custom type whose name is one gets its module and class name instead)."""
    from ._compat import CACHE_NAMES  # (torch: imported already where a model class exists)

    forward = cls.__dict__.get("forward")
    if forward is None or cls.__module__.startswith("transformers.") or cls.__module__ == "transformers":
        return None
    try:
        parameters = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return None
    source = source_of(forward)
    if source is None:
        return None
    takes_inputs = "input_ids" in parameters or "inputs_embeds" in parameters
    if not (takes_inputs and "attention_mask" in parameters and any(n in parameters for n in CACHE_NAMES)):
        return None
    arch = _arch(cls, taken)
    target = f"{cls.__module__}:{cls.__qualname__}.forward"
    if "position_ids" not in parameters:
        return Recognised(cls, arch, None, f"{target} takes no position_ids: its positions are its own")
    if not fills_positions_when_none(source):
        return None  # hands position_ids on (a wrapper): its base model is the one recognised
    how = "recognised from its forward (input_ids, attention_mask, a cache, position_ids it fills when None)"
    adapter = Adapter(arch, cls.__name__, CUSTOM, "", source=cls.__module__, recognised=how)
    return Recognised(cls, arch, adapter, how)


def _arch(cls: type, taken: Any) -> str:
    """The config's ``model_type``, or (none, or one hfpatch knows already) ``module.Class``."""
    config_class = getattr(cls, "config_class", None)
    model_type = getattr(config_class, "model_type", "") or ""
    if isinstance(model_type, str) and model_type and model_type not in taken:
        return model_type
    return f"{cls.__module__}.{cls.__qualname__}"


def namespace(cls: type) -> Any:
    """What :func:`hfpatch.build.build` reads for ``cls``: its module's names (its rotary classes), with
    ``cls`` under its own name (a class defined inside a function is no attribute of its module)."""
    module = sys.modules.get(cls.__module__)
    names = dict(vars(module)) if module is not None else {}
    names[cls.__name__] = cls
    found = types.SimpleNamespace(**names)
    found.__name__ = cls.__module__
    return found


class Checks:
    """The check a recognised class passes before it is patched: (patch it?, why), run once per class,
    in the thread that first wants it, outside the engine's lock. While it runs, :meth:`checking_here`
    tells the engine that the checking thread's own ``patched()`` blocks (its ``verify`` of the tiny
    copy) may install the rows; a thread that wants a class another one is checking waits for its
    verdict. Until the package wires the check in (:func:`check_classes_with`), nothing is checked."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._check: Optional[Callable[[type], tuple[bool, str]]] = None
        self._verdicts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # class -> (bool, why)
        self._running: dict[type, tuple[int, threading.Event]] = {}  # class -> (its thread, set when done)

    def use(self, check: Callable[[type], tuple[bool, str]]) -> None:
        self._check = check

    def verdict(self, cls: type) -> tuple[Optional[bool], str]:
        """(True: patch it, False: leave it alone, None: not checked yet), why."""
        return self._verdicts.get(cls, (None, "not checked yet"))

    def checking_here(self, cls: type) -> bool:
        running = self._running.get(cls)
        return running is not None and running[0] == threading.get_ident()

    def run(self, classes: Iterable[type]) -> None:
        """Check each of ``classes`` without a verdict yet, in this thread; then wait for those another
        thread is checking. Call it without the engine's lock held."""
        if self._check is None:
            return
        mine: list[tuple[type, threading.Event]] = []
        theirs: list[threading.Event] = []
        with self._lock:
            for cls in classes:
                if self.verdict(cls)[0] is not None:
                    continue
                running = self._running.get(cls)
                if running is None:
                    event = threading.Event()
                    self._running[cls] = (threading.get_ident(), event)
                    mine.append((cls, event))
                elif running[0] != threading.get_ident():
                    theirs.append(running[1])
        for cls, event in mine:
            verdict: tuple[Optional[bool], str] = (None, "not checked yet (its check was interrupted)")
            try:
                verdict = self._check(cls)
            except NameError as exc:  # its module is still being imported: checked at the next look
                verdict = (None, f"not checked yet (its module is being imported: {exc})")
            finally:
                with self._lock:  # recorded before the threads waiting for it wake
                    self._verdicts[cls] = verdict
                    del self._running[cls]
                event.set()
        for event in theirs:
            event.wait()


CHECKS = Checks()


def check_classes_with(check: Callable[[type], tuple[bool, str]]) -> None:
    """The check a recognised class outside transformers must pass before it is patched: (patch it?,
    why). The package sets it (``hfpatch/__init__.py``); until then no such class is patched."""
    CHECKS.use(check)


def pretrained_model() -> Optional[type]:
    """transformers' ``PreTrainedModel``, where transformers is imported (else None: nothing to look at)."""
    module = sys.modules.get("transformers.modeling_utils")
    return getattr(module, "PreTrainedModel", None)


class Watch:
    """While ``apply()`` holds, a subclass of ``PreTrainedModel`` defined later (a remote-code module
    imported, a class in the user's program) is handed to ``on_class`` when it is created:
    ``PreTrainedModel.__init_subclass__`` replaced (a row of the engine's ledger, under its own pin),
    now if transformers is imported, else when it is (a post-import hook, registered once: wrapt keeps
    hooks for good). ``on_class`` runs with the engine's ``lock`` held, once per class (:meth:`unseen`
    yields the others); :meth:`start` and :meth:`stop` are called with it held."""

    def __init__(self, ledger: Ledger, lock: Any, on_class: Callable[[type], None]) -> None:
        self.pin = Pin("classes defined after apply()")
        self._ledger, self._lock, self._on_class = ledger, lock, on_class
        self._hooked = False
        self._seen: weakref.WeakSet[type] = weakref.WeakSet()  # subclasses of PreTrainedModel looked at

    def unseen(self) -> Iterator[type]:
        """Every subclass of ``PreTrainedModel`` not looked at yet (marked as it is yielded)."""
        base = pretrained_model()
        stack = list(type.__subclasses__(base)) if base is not None else []
        while stack:
            cls = stack.pop()
            stack.extend(type.__subclasses__(cls))
            if cls not in self._seen:
                self._seen.add(cls)
                yield cls

    def start(self) -> None:
        self.pin.pinned = True
        if pretrained_model() is not None:
            self._install()
        elif not self._hooked:
            import wrapt

            wrapt.register_post_import_hook(self._install, "transformers.modeling_utils")
            self._hooked = True

    def stop(self) -> None:
        self.pin.pinned = False
        self._ledger.revert(self.pin, self._ledger.installed_by(self.pin))

    def _install(self, *_: Any) -> None:
        with self._lock:
            base = pretrained_model()
            if base is not None and self.pin.pinned and not self._ledger.installed_by(self.pin):
                original = base.__dict__.get("__init_subclass__", ABSENT)
                hook = _subclass_hook(base, original, self._new)
                self._ledger.install(self.pin, (Patch(base, "__init_subclass__", original, hook),))

    def _new(self, cls: type) -> None:
        with self._lock:
            if self.pin.pinned and cls not in self._seen:
                self._seen.add(cls)
                self._on_class(cls)


def _subclass_hook(base: type, original: Any, on_class: Callable[[type], None]) -> classmethod:
    """The ``__init_subclass__`` :class:`Watch` puts on ``base`` (``PreTrainedModel``):
    the class's own (``original``, or ``object``'s), then ``on_class`` for a class outside transformers.
    Nothing it does may break the definition of a class."""

    def __init_subclass__(cls: type, **kwargs: Any) -> None:
        if original is ABSENT:
            super(base, cls).__init_subclass__(**kwargs)
        else:
            original.__get__(None, cls)(**kwargs)
        if cls.__module__.startswith("transformers."):
            return  # transformers' own classes: declared, or known and not patched
        try:
            on_class(cls)
        except Exception:  # noqa: BLE001 - never break the definition of a class
            pass

    return classmethod(__init_subclass__)
