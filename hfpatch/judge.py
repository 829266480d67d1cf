"""The audit's judgement of one call (:mod:`hfpatch.auditing`): what stock transformers gets wrong in
it by positions, read from its arguments before it runs, by the rules hfpatch's families encode
(:func:`hfpatch.positions.stock_error`), and where it was called from."""

from __future__ import annotations

import contextlib
import sys
import threading
import weakref
from typing import Any, Optional

import torch

from ._compat import output_cache
from ._context import CALL
from .backends import SDPA, backend_of
from .caches import capacity, first_layer_keys, past_length, state_length
from .declarations import PADDED_TABLE, SINUSOID, TABLE
from .observers import call_site, fingerprint, keys_fingerprint
from .packed import packed_rows
from .positions import new_token_positions, packed_stock_error, stock_error
from .rope import DYNAMIC, scaled_rope
from .sources import hands_positions_to_mask_functions, source_of, state_mixers
from .support import in_range, installed_transformers
from .windows import CHUNKED, layer_types, positional, text_config, window_of

__all__ = [
    "OWN_POSITIONS",
    "Watcher",
    "the_masks_positions",
]

ABSOLUTE_HANDS_TO = (TABLE, SINUSOID, PADDED_TABLE)  # decoders whose position module is a table or sinusoid


class Watcher:
    """Judges each watched call before it runs; never changes it, never raises into it."""

    def __init__(self, report: Any) -> None:  # an hfpatch.auditing.AuditReport
        self.report = report
        self.facts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> _Facts
        # id(cache) -> (its first layer's keys as the call that filled it left them, how each column it
        # holds was numbered: [1, columns] bool, True: by column (a call without positions), False: by the
        # mask; None: unknown (the caller's own)). The keys, not the cache: a legacy tuple has no weak
        # reference, and a cache changed outside the calls (cropped, reordered) has other keys
        self.numbered: dict[int, tuple[weakref.ref, Optional[torch.Tensor]]] = {}
        self.lock = threading.Lock()

    def __call__(self, seen: Any, call: Any) -> Any:
        numbering = None
        try:
            numbering = self.observe(seen)
        except Exception as exc:  # noqa: BLE001 - an audit must never break the run
            self._count(seen, seen.adapter.arch, None, f"the audit failed: {type(exc).__name__}")
        result = call()
        with contextlib.suppress(Exception):  # noqa: BLE001
            self.follow(result, numbering)
        return result

    def observe(self, seen: Any) -> Any:
        """Judge the call; return how the columns of the cache it returns are numbered (or None)."""
        facts = self._facts(seen)
        before = self.numbering_of(seen.cache)
        verdict = _judge(seen, facts, before)
        if isinstance(verdict, str):
            self._count(seen, facts.arch, None, verdict)
        else:
            self._count(seen, facts.arch, verdict, None)
        if before is UNKNOWN:
            return UNKNOWN
        tokens = seen.kwargs.get("input_ids")
        tokens = tokens if tokens is not None else seen.kwargs.get("inputs_embeds")
        given = seen.kwargs.get("position_ids") is not None
        if tokens is None or tokens.dim() < 2 or (given and verdict == OWN_POSITIONS):
            return UNKNOWN
        new = torch.full((1, tokens.shape[1]), not given, dtype=torch.bool, device=tokens.device)
        return new if before is None else torch.cat([before.to(new.device), new], 1)

    def numbering_of(self, cache: Any) -> Any:
        """How the columns ``cache`` holds were numbered: None for no cache (or an empty one); UNKNOWN for
        one this audit did not see filled and cannot match to one it did (a copy is matched by its keys)."""
        if cache is None or past_length(cache) == 0:
            return None
        with self.lock:
            found = self.numbered.get(id(cache))
        keys = first_layer_keys(cache)
        if found is not None and keys is not None and found[0]() is keys:
            numbering = found[1]
            return (
                numbering if numbering is not None and numbering.shape[1] == past_length(cache) else UNKNOWN
            )
        stamp = fingerprint(cache)  # a copy (copy.deepcopy of a prompt cache): the same keys
        with self.lock:
            known = [(ref(), numbering) for ref, numbering in self.numbered.values()]
        for other, numbering in known:  # the keys of a cache seen filled
            if other is not None and other is not keys and numbering is not None:
                if numbering.shape[1] == past_length(cache) and keys_fingerprint(other) == stamp[1]:
                    return numbering
        return UNKNOWN

    def follow(self, result: Any, numbering: Any) -> None:
        """Remember how the columns of the cache ``result`` returns are numbered."""
        if numbering is None or isinstance(result, (tuple, list)):
            return
        cache = output_cache(result)
        keys = first_layer_keys(cache) if cache is not None else None
        if keys is None:
            return
        with self.lock:
            self.numbered[id(cache)] = (weakref.ref(keys), None if numbering is UNKNOWN else numbering)
            if len(self.numbered) > 64:  # the caches of finished chains
                for key in [key for key, (ref, _) in self.numbered.items() if ref() is None]:
                    del self.numbered[key]

    def _facts(self, seen: Any) -> _Facts:
        model = seen.model
        facts = self.facts.get(model)
        if facts is None:
            facts = self.facts[model] = _Facts(model, seen.adapter)
        return facts

    def _count(self, seen: Any, arch: str, stats: Optional[list[int]], unjudged: Optional[str]) -> None:
        # stats: [rows, tokens, worst shift] stock got wrong, and 1 where the call packs rows
        given = unjudged == OWN_POSITIONS
        self.report.count(arch, call_site()[0], seen.patched, given, None if given else unjudged, stats)


class _Facts:
    """What the rules need of a model, read once: relative positions?, each layer's window, rope
    scaled by length (kind, original context), or why its calls cannot be judged."""

    def __init__(self, model: Any, adapter: Any) -> None:
        self.arch = getattr(getattr(model, "config", None), "model_type", None) or adapter.arch
        family = adapter.family
        if family.name == "custom":  # a class outside transformers: rotary if it has a rotary module
            self.relative = any("rotary" in type(m).__name__.lower() for m in model.modules())
        else:
            self.relative = (
                not family.name.startswith("absolute") and family.hands_to not in ABSOLUTE_HANDS_TO
            )
        self.unjudged: Optional[str] = None
        self.windows: list[Optional[int]] = []
        try:
            config = text_config(model)
            kinds = layer_types(config)
        except AttributeError:  # a config without layers (a custom model's): full attention
            kinds = []
        if CHUNKED in kinds:
            self.unjudged = "attention chunks"
        sizes = [(window_of(config, kind) or (None, None))[0] for kind in kinds]
        self.windows = sizes if any(sizes) else []
        # a release whose window code hfpatch does not read: its own rule (off by one in some), not judged
        self.own_windows = bool(self.windows) and not positional(model, adapter.cls)
        # 4.36-4.37's SDPA mask of a padded cached prefix continued by several tokens (Adapter.eager_mask):
        # wrong whatever the positions, so such calls are not judged there
        version = installed_transformers()
        self.own_mask = (
            adapter.eager_mask is not None
            and version is not None
            and in_range(adapter.eager_mask[0], version)
            and getattr(getattr(model, "config", None), "_attn_implementation", None) == SDPA
        )
        self.scaled = scaled_rope(model)
        self.detects_packing = _detects_packing(model, adapter)


def _detects_packing(model: Any, adapter: Any) -> bool:
    """Whether the release's own mask code keeps a packed row to its sequences when the call has neither
    a mask nor a cache (masking_utils, 4.53+, for a class that hands its positions to it), or its flash
    attention does (without a mask: by the positions). Never where the model has layers that carry a state
    (:mod:`hfpatch.mixers`): no mask reaches them."""
    owner = next((type(m) for m in model.modules() if type(m).__name__ == adapter.cls), None)
    if owner is not None and state_mixers(sys.modules.get(owner.__module__)):
        return False  # (layers that carry a state take no mask: transformers' own packing leaves them whole)
    used = backend_of(getattr(getattr(model, "config", None), "_attn_implementation", None))
    if used is not None and used.own_packing:
        return True
    masking = sys.modules.get("transformers.masking_utils")
    if getattr(masking, "find_packed_sequence_indices", None) is None:
        return False
    source = source_of(owner.forward) if owner is not None else None
    return source is not None and hands_positions_to_mask_functions(source)


def _judge(seen: Any, facts: _Facts, numbering: Any = None) -> Any:
    """``[rows, tokens, worst shift]`` stock gets wrong in this call (and 1 where it packs rows), or why
    it is not judged. A call with the caller's positions is judged where they are the ones the mask
    gives (``generate()``'s). ``numbering``: how the columns of the cache it continues were numbered
    (:meth:`Watcher.numbering_of`)."""
    if CALL.unpadding:  # the packed row of a padded call run on its real tokens: that call was not seen
        return UNPADDED_CALL
    kwargs = seen.kwargs
    given = kwargs.get("position_ids")
    tokens = kwargs.get("input_ids")
    tokens = tokens if tokens is not None else kwargs.get("inputs_embeds")
    tokens = tokens if tokens is not None and tokens.dim() >= 2 else None
    if given is not None:
        packed = _judge_packed(seen, facts, tokens)
        if packed is not None:
            return packed
    if seen.adapter.family.from_mask:  # its own positions from the mask: right on stock with padding
        return [0, 0, 0]
    mask = kwargs.get("attention_mask")
    if mask is None:  # no padding: stock's positions are the reference's, or the caller's own
        if given is None or tokens is None:
            return [0, 0, 0]
        past = past_length(seen.cache) if capacity(seen.cache) is None else None
        if past is None or given.dim() != 2 or given.shape[-1] != tokens.shape[1]:
            return OWN_POSITIONS
        expected = torch.arange(tokens.shape[1], device=given.device) + past
        return [0, 0, 0] if bool((given == expected).all()) else OWN_POSITIONS
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return "a 4-D or non-tensor mask"
    if facts.unjudged is not None:
        return facts.unjudged
    if tokens is None:
        return "no input_ids or inputs_embeds"
    cache = seen.cache
    if capacity(cache) is not None:
        return "a static cache"
    num_new, length = tokens.shape[1], mask.shape[1]
    held = state_length(cache)  # (None: a cache of state layers alone that counts nothing: the mask says)
    if held is not None and held + num_new != length:
        return "a mask that is not past + new tokens long"
    if given is not None and not the_masks_positions(given, mask, num_new):
        return OWN_POSITIONS
    if facts.own_mask and 1 < num_new < length and bool((mask == 0).any()):
        return "this release's SDPA mask of a padded cached prefix continued by several tokens"
    if facts.own_windows and length > min(w for w in facts.windows if w):
        return "a sliding window by this release's own rule"
    if numbering is UNKNOWN:
        return "a cache this audit did not see filled"
    new = torch.full((1, num_new), given is None, dtype=torch.bool, device=mask.device)
    by_column = None if numbering is None and given is None else (
        new if numbering is None else torch.cat([numbering.to(mask.device), new], 1)
    )  # fmt: skip
    error = stock_error(mask, num_new, facts.relative, facts.windows, by_column)
    if facts.scaled is not None and given is None:  # a row scaled otherwise than alone: wrong at every token
        kind, original = facts.scaled
        own = (mask != 0).sum(-1)
        if kind == DYNAMIC:
            rows = (own != length) & (own.clamp(min=length) > original)
        else:
            rows = (own > original) != (length > original)
        error = torch.where(rows[:, None] & (mask[:, length - num_new :] != 0), error.clamp(min=1), error)
    if num_new == 1:  # a decode step: one value per row, read at once
        per_row = error.view(-1).tolist()
        worst = max(per_row, default=0)
        per_row = [1 if v else 0 for v in per_row]
    else:
        per_row, worst = (error > 0).sum(-1).tolist(), int(error.max())
    tokens = sum(per_row)
    return [len(per_row) - per_row.count(0), tokens, worst] if tokens else [0, 0, 0]


OWN_POSITIONS = "the caller's own positions (not the mask's)"
UNPADDED_CALL = "run on its real tokens (apply(unpad=True))"
UNKNOWN = object()  # how a cache's columns were numbered, where the audit cannot tell


def the_masks_positions(given: torch.Tensor, mask: torch.Tensor, num_new: int) -> bool:
    """Whether the caller's positions are those of the mask at every real new token (``generate()``'s)."""
    if given.dim() != 2 or given.shape[-1] != num_new:
        return False
    real = mask[:, mask.shape[1] - num_new :] != 0
    derived = new_token_positions(mask, num_new)
    return bool(((given.to(derived.device) - derived) * real).eq(0).all())


def _judge_packed(seen: Any, facts: _Facts, tokens: Any) -> Any:
    """A call whose caller's positions restart inside a row (a packed batch): the tokens stock lets see
    the sequences before them, and 1 (a packed call); None for any other call."""
    kwargs = seen.kwargs
    found = packed_rows(kwargs, tokens)
    if found is None:
        return None
    mask, segment_ids = found.mask, found.segment_ids
    uses_cache = kwargs.get("use_cache")
    if uses_cache is None:
        uses_cache = getattr(getattr(seen.model, "config", None), "use_cache", True)
    if seen.model.training and getattr(seen.model, "gradient_checkpointing", False):
        uses_cache = False  # transformers turns the cache off for checkpointed training
    given = kwargs.get("attention_mask")
    if facts.detects_packing and given is None and seen.cache is None and not uses_cache:
        return [0, 0, 0, 1]  # transformers' own packed path
    if facts.own_windows or facts.scaled is not None or facts.unjudged is not None:
        why = facts.unjudged or (
            "rope scaled by length" if facts.scaled else "a window by this release's own rule"
        )
        return f"a packed row with {why}"
    wrong = packed_stock_error(segment_ids, given, facts.windows).expand(mask.shape)
    per_row = wrong.sum(-1).tolist()
    count = sum(per_row)
    return [len(per_row) - per_row.count(0), count, 0, 1] if count else [0, 0, 0, 1]
