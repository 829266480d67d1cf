"""The audit's judgement of one call (:mod:`hfpatch.auditing`): what stock transformers gets wrong in
it by positions, read from its arguments before it runs, by the rules hfpatch's families encode
(:func:`hfpatch.positions.stock_error`), and where it was called from."""

from __future__ import annotations

import contextlib
import inspect
import os
import re
import sys
import weakref
from typing import Any, Optional

import torch

from .caches import capacity, past_length
from .declarations import PADDED_TABLE, SINUSOID, TABLE
from .packed import packed_rows
from .positions import packed_stock_error, stock_error
from .rope import DYNAMIC, scaled_rope
from .support import in_range, installed_transformers
from .windows import CHUNKED, _layer_types, _text_config, _window_of, positional

__all__ = ["GIVEN", "Watcher", "call_site"]

ABSOLUTE_HANDS_TO = (TABLE, SINUSOID, PADDED_TABLE)  # decoders whose position module is a table or sinusoid
INTERNAL = ("transformers", "torch", "hfpatch")  # frames skipped to find a call site
GIVEN = "positions given"


class Watcher:
    """Judges each watched call before it runs; never changes it, never raises into it."""

    def __init__(self, report: Any) -> None:  # an hfpatch.auditing.AuditReport
        self.report = report
        self.facts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> _Facts

    def __call__(self, seen: Any, call: Any) -> Any:
        try:
            self.observe(seen)
        except Exception as exc:  # noqa: BLE001 - an audit must never break the run
            self._count(seen, seen.adapter.arch, None, f"the audit failed: {type(exc).__name__}")
        return call()

    def observe(self, seen: Any) -> None:
        facts = self._facts(seen)
        verdict = _judge(seen, facts)
        if isinstance(verdict, str):
            self._count(seen, facts.arch, None, verdict)
        else:
            self._count(seen, facts.arch, verdict, None)

    def _facts(self, seen: Any) -> _Facts:
        model = seen.model
        facts = self.facts.get(model)
        if facts is None:
            facts = self.facts[model] = _Facts(model, seen.adapter)
        return facts

    def _count(self, seen: Any, arch: str, stats: Optional[list[int]], unjudged: Optional[str]) -> None:
        # stats: [rows, tokens, worst shift] stock got wrong, and 1 where the call packs rows
        site = call_site()[0]
        report = self.report
        with report._lock:
            entry = report.entry(arch)
            entry["calls"] += 1
            entry["patched"] += seen.patched
            at = entry["sites"].setdefault(site, [0, 0])
            at[0] += 1
            if unjudged == GIVEN:
                entry["positions_given"] += 1
            elif unjudged is not None:
                entry["not_judged"][unjudged] = entry["not_judged"].get(unjudged, 0) + 1
            if stats is not None and stats[3:]:
                entry["packed"] += 1
            if stats is not None and stats[0]:
                entry["affected"] += 1
                at[1] += 1
                entry["rows"] += stats[0]
                entry["tokens"] += stats[1]
                entry["worst_shift"] = max(entry["worst_shift"], stats[2])


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
            config = _text_config(model)
            kinds = _layer_types(config)
        except AttributeError:  # a config without layers (a custom model's): full attention
            kinds = []
        if CHUNKED in kinds:
            self.unjudged = "attention chunks"
        sizes = [(_window_of(config, kind) or (None, None))[0] for kind in kinds]
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
            and getattr(getattr(model, "config", None), "_attn_implementation", None) == "sdpa"
        )
        self.scaled = scaled_rope(model)
        self.detects_packing = _detects_packing(model, adapter)


def _detects_packing(model: Any, adapter: Any) -> bool:
    """Whether the release's own mask code keeps a packed row to its sequences when the call has neither
    a mask nor a cache (masking_utils, 4.53+, for a class that hands its positions to it), or its flash
    attention does (without a mask: by the positions)."""
    attention = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if isinstance(attention, str) and attention.startswith("flash"):
        return True
    masking = sys.modules.get("transformers.masking_utils")
    if getattr(masking, "find_packed_sequence_indices", None) is None:
        return False
    owner = next((type(m) for m in model.modules() if type(m).__name__ == adapter.cls), None)
    try:
        source = inspect.getsource(inspect.unwrap(owner.forward)) if owner is not None else ""
    except (OSError, TypeError):
        return False
    return bool(_HANDS_POSITIONS.search(source))


# a call of masking_utils' mask functions that passes the positions (or a dict of their arguments with them)
_HANDS_POSITIONS = re.compile(
    r"create_(?:causal|sliding_window_causal|chunked_causal)_mask\((?:[^()]|\([^()]*\))*position_ids"
    r"|[\"']position_ids[\"']\s*:\s*position_ids"
)


def _judge(seen: Any, facts: _Facts) -> Any:
    """``[rows, tokens, worst shift]`` stock gets wrong in this call, or why it is not judged."""
    kwargs = seen.kwargs
    if kwargs.get("position_ids") is not None:
        return _judge_packed(seen, facts)
    mask = kwargs.get("attention_mask")
    if mask is None:
        return [0, 0, 0]  # stock's positions are the reference's
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return "a 4-D or non-tensor mask"
    if facts.unjudged is not None:
        return facts.unjudged
    tokens = kwargs.get("input_ids")
    tokens = tokens if tokens is not None else kwargs.get("inputs_embeds")
    if tokens is None or tokens.dim() < 2:
        return "no input_ids or inputs_embeds"
    cache = seen.cache
    if capacity(cache) is not None:
        return "a static cache"
    num_new, length = tokens.shape[1], mask.shape[1]
    if past_length(cache) + num_new != length:
        return "a mask that is not past + new tokens long"
    if facts.own_mask and 1 < num_new < length and bool((mask == 0).any()):
        return "this release's SDPA mask of a padded cached prefix continued by several tokens"
    if facts.own_windows and length > min(w for w in facts.windows if w):
        return "a sliding window by this release's own rule"
    error = stock_error(mask, num_new, facts.relative, facts.windows)
    if facts.scaled is not None:  # a row scaled otherwise than alone: wrong at every token (shift >= 1)
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


def _judge_packed(seen: Any, facts: _Facts) -> Any:
    """A call with the caller's positions: where they restart inside a row (a packed batch), the tokens
    stock lets see the sequences before them; any other is the caller's (not judged)."""
    kwargs = seen.kwargs
    tokens = kwargs.get("input_ids")
    tokens = tokens if tokens is not None else kwargs.get("inputs_embeds")
    found = packed_rows(kwargs, tokens if tokens is not None and tokens.dim() >= 2 else None)
    if found is None:
        return GIVEN
    mask, _, segment_ids = found
    uses_cache = kwargs.get("use_cache")
    if uses_cache is None:
        uses_cache = getattr(getattr(seen.model, "config", None), "use_cache", True)
    if seen.model.training and getattr(seen.model, "gradient_checkpointing", False):
        uses_cache = False  # transformers turns the cache off for checkpointed training
    given = kwargs.get("attention_mask")
    if facts.detects_packing and given is None and seen.cache is None and not uses_cache:
        return [0, 0, 0, 1]  # transformers' own packed path
    if facts.own_windows or facts.scaled is not None or facts.unjudged is not None:
        return "a packed row with " + (
            facts.unjudged
            or ("rope scaled by length" if facts.scaled else "a window by this release's own rule")
        )
    wrong = packed_stock_error(segment_ids, given, facts.windows).expand(mask.shape)
    per_row = wrong.sum(-1).tolist()
    tokens = sum(per_row)
    return [len(per_row) - per_row.count(0), tokens, 0, 1] if tokens else [0, 0, 0, 1]


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
