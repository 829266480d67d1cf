"""What a target's signature says, read once when its class is patched: a :class:`Plan`.

The plan decides which filler the patched ``forward`` runs (:mod:`hfpatch.forward`), so that the
per-call path holds only what a call can change:

- :data:`NO_SLOTS`: the release has no ``cache_position`` (before 4.38 for Llama, 4.52 for GPT-2):
  positions only;
- :data:`SLOTS`: the parameter exists (4.38-5.3): positions, and a static cache's slots where the
  caller leaves them out;
- :data:`SLOTS_REMOVED`: the parameter is gone and ``**kwargs`` would swallow it (5.4+): positions,
  and a passed ``cache_position`` honoured instead of ignored.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any, NamedTuple, Optional

from ._compat import CACHE_NAMES, attaches_static_caches
from .declarations import Adapter
from .sources import keeps_keys, state_mixers
from .support import in_range, installed_transformers
from .windows import mask_plan

__all__ = ["NO_SLOTS", "SLOTS", "SLOTS_REMOVED", "Plan", "read_plan"]

REQUIRED = ("input_ids", "attention_mask", "position_ids", "inputs_embeds")

NO_SLOTS = "no cache_position"
SLOTS = "cache_position"
SLOTS_REMOVED = "cache_position removed"


class Plan(NamedTuple):
    """What a target's signature (and the installed release) says, read once per patched class."""

    positional: tuple[str, ...]  # parameters after ``self`` that may be passed by position, in order
    cache_kw: Optional[str]  # "cache" (5.24+), "past_key_values", or None (no KV cache: OpenAI GPT)
    era: str  # NO_SLOTS, SLOTS or SLOTS_REMOVED
    old_cache_kw: Optional[str] = None  # an old name the release still takes, with its own warning (5.24+)
    attached_cache: Optional[str] = None  # where 4.38-4.40 ``_setup_cache`` keeps a static cache
    eager_mask_attr: Optional[str] = None  # see ``Adapter.eager_mask``: only where its releases match
    masks: Any = None  # a ``hfpatch.windows.MaskPlan`` where the class's mask code takes a 4-D mask
    ids_rank: int = 2  # ``Family.ids_rank``: 3 for audio codes ``[batch, tokens, channels]``
    handed: bool = False  # a task head hands it positions it drops itself (``CALL.handed``: 5.x's BLOOM)
    mixers: bool = False  # its module has layers that carry a state, run by sequence (hfpatch.mixers)
    steps: bool = False  # ... one token at a time in a cached call of several (``Adapter.steps``, here)
    keeps_keys: bool = False  # its attention keeps its keys on itself: its packed rows are not kept
    # neither it nor a task head takes position_ids (4.42-4.47's RWKV): no packed row can be passed (build's)
    no_positions: bool = False


def read_plan(adapter: Adapter, forward: Callable, owner: Optional[type] = None) -> Plan:
    """Read ``forward``'s signature (``owner``: its class); ``TypeError`` saying what is missing if it is
    not the expected one (``Plan.handed`` is build's to set: it reads the module's task heads)."""
    try:
        params = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError) as exc:
        raise TypeError(f"cannot read the signature of {adapter.target}: {exc}") from exc
    names = [p.name for p in params]
    # a forward whose positions are handed to its position module (hfpatch.decoders) takes none itself
    # (and reads only the ids and the mask: SpeechT5's text prenet takes no inputs_embeds)
    required = REQUIRED if adapter.family.hands_to is None else ("input_ids", "attention_mask")
    if not adapter.family.attends:  # (no attention: no positions either; a mask its **kwargs take: xLSTM's)
        keywords = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
        required = tuple(
            n for n in required if n != "position_ids" and not (keywords and n == "attention_mask")
        )
    if adapter.family.ids_rank != 2:  # audio codes: no inputs_embeds
        required = tuple(name for name in required if name != "inputs_embeds")
    missing = [name for name in required if name not in names]
    if not names or names[0] != "self":
        missing.insert(0, "self")
    if missing:
        found = ", ".join(names)
        raise TypeError(f"signature mismatch: {adapter.target}({found}) lacks {', '.join(missing)}")
    positional_kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if "cache_position" in names:
        era = SLOTS
    elif any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        era = SLOTS_REMOVED
    else:
        era = NO_SLOTS
    version, eager_mask = installed_transformers(), adapter.eager_mask
    in_era = eager_mask is not None and version is not None and in_range(eager_mask[0], version)
    cache_kw = next((name for name in CACHE_NAMES if name in names), None)
    held = owner is not None and keeps_keys(sys.modules.get(owner.__module__))
    family = adapter.family
    attached = family.attached_cache if era == SLOTS and attaches_static_caches(owner) else None
    return Plan(
        positional=tuple(p.name for p in params[1:] if p.kind in positional_kinds),
        cache_kw=cache_kw,
        era=era,
        old_cache_kw=_renamed_from(forward, cache_kw),
        attached_cache=attached,
        eager_mask_attr=eager_mask[1] if in_era else None,
        # the masks of seq2seq stacks that take no positions stay transformers' (none has a window); a
        # seq2seq decoder packs no rows; a multimodal text model's windows stay transformers' (the forward
        # leaves them: Family.multimodal), its packed rows are kept where its mask code takes a 4-D mask
        masks=None
        if owner is None or (family.hands_to and not family.from_mask)
        else mask_plan(owner, not family.seq2seq),
        ids_rank=family.ids_rank,
        # (where its attention keeps its keys on itself, the model's cache is its own: its state layers
        # too run as transformers runs them: RecurrentGemma before 5.4)
        mixers=owner is not None and not held and bool(state_mixers(sys.modules.get(owner.__module__))),
        keeps_keys=held,
        steps=bool(adapter.steps) and version is not None and in_range(adapter.steps, version),
    )


def _renamed_from(forward: Callable, new_name: Optional[str]) -> Optional[str]:
    """The old name of the cache argument that the release still takes, through transformers'
    ``deprecate_kwarg`` decorator (5.24: ``past_key_values`` -> ``cache``), which warns the caller.
    Read from the decorator's closure, anywhere on the ``__wrapped__`` chain."""
    function: Any = forward
    while function is not None and new_name is not None:
        code = getattr(function, "__code__", None)
        if code is not None and {"old_name", "new_name"} <= set(code.co_freevars):
            cells = dict(zip(code.co_freevars, function.__closure__ or ()))
            try:
                old, new = (cells[name].cell_contents for name in ("old_name", "new_name"))
            except (KeyError, ValueError):  # an empty cell: not the decorator we know
                old = new = None
            if new == new_name and old in CACHE_NAMES:
                return old
        function = getattr(function, "__wrapped__", None)
    return None
