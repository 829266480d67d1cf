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
is untouched), in fp32 on the CPU.
"""

from __future__ import annotations

import inspect
import re
import sys
import types
from typing import Any, NamedTuple, Optional

from .declarations import Adapter, Family

__all__ = ["CUSTOM", "Recognised", "namespace", "recognise"]

CUSTOM = Family("custom")  # takes position_ids, as transformers' own decoders do
_NONE_CHECK = re.compile(r"\bposition_ids\s+is\s+(not\s+)?None\b")


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
        source = inspect.getsource(inspect.unwrap(forward))
    except (OSError, TypeError, ValueError):
        return None
    takes_inputs = "input_ids" in parameters or "inputs_embeds" in parameters
    if not (takes_inputs and "attention_mask" in parameters and any(n in parameters for n in CACHE_NAMES)):
        return None
    arch = _arch(cls, taken)
    target = f"{cls.__module__}:{cls.__qualname__}.forward"
    if "position_ids" not in parameters:
        return Recognised(cls, arch, None, f"{target} takes no position_ids: its positions are its own")
    if not _NONE_CHECK.search(source):
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
