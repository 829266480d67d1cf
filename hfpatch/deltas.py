"""A multimodal-rope wrapper's calls without positions (the Qwen-VL family: Qwen2-VL, Qwen2.5-VL, Qwen3-VL,
GLM-4V ...).

Such a wrapper numbers a prefill's tokens itself (``get_rope_index``: an image's tokens take fewer
positions than tokens) and keeps, on the instance, each row's ``rope_deltas``, from which its later calls
count: ``cache length + rope_deltas + j`` (before 5.3: the next position less the cache's length), or
``real tokens + rope_deltas + j`` over the call's mask (5.3+: the next position less the real tokens). A
pad among the new tokens, or in an earlier cached call, shifts every position after it before 5.3; a
cached call without ``cache_position`` fails outright there (its mask of past and new tokens meets the new
tokens alone), as one that continues an image prefill with a mask does on 5.3+. Some releases' deltas are
off besides: a text prefill's row of one real token (a pad counts as position 1 before 5.2), Qwen2.5-VL's
image rows on 5.4, measured (the largest position, not the last token's).

:func:`continuing` numbers a cached call that gives no positions and no image by real tokens: its new
tokens' positions are each row's next position plus the real tokens before each, and the row's deltas
follow (``rope_deltas + real - new`` before 5.3), so that the next call starts where this one ended. A
prefill's deltas are each row's last token's position plus one, less its real tokens (or the prefill's
length), as a one-call run continues. Where the wrapper numbers a text-only prefill itself (before 5.2),
it is numbered here by real tokens too; on 5.2+ the text model's patch numbers a text conversation. Calls
with positions (``generate()`` passes its own), with images after the prefill, and compiled calls are the
wrapper's own.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor

from . import caches
from ._compat import CACHE_NAMES, passed
from ._context import Pin, patched_here
from .patches import Patch
from .positions import restarts, segments
from .sources import source_of

__all__ = ["continuing", "delta_rows"]

VISION = ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw")
BY_REAL = "len(current_input_ids)"  # 5.3+: a row's deltas its next position less its real tokens


class Deltas(NamedTuple):
    """What a wrapper's ``rope_deltas`` mean on a release, read once from its code."""

    numbers_text: bool  # it numbers a text-only prefill itself (before 5.2: ``get_rope_index``)
    by_real: bool  # each row's next position less its real tokens (5.3+), else less the cache's length


def delta_rows(module: Any, pin: Pin) -> list[Patch]:
    """The ``forward`` of each class of ``module`` that keeps ``rope_deltas`` and numbers its own prefill
    (it defines ``get_rope_index``): the wrapper (4.52+), or the model with a head before it (4.45-4.51)."""
    rows = []
    for value in vars(module).values():
        own = getattr(value, "__dict__", {})
        if isinstance(value, type) and "get_rope_index" in own and "forward" in own:
            rule = Deltas(
                # 5.2+: a text-only call's positions are left to the text model (compute_3d_position_ids)
                numbers_text=not hasattr(value, "compute_3d_position_ids"),
                by_real=BY_REAL in (source_of(own["get_rope_index"]) or ""),
            )
            rows.append(Patch(value, "forward", own["forward"], continuing(own["forward"], pin, rule)))
    return rows


class _Call(NamedTuple):
    past: int  # the tokens the cache holds
    real: Tensor  # [rows, new]: 1 where a new token is real, 0 at a pad
    seen: Any  # the real tokens each row's cache holds ([rows, 1]; ``past`` where the call gives no mask)
    images: bool  # it gives images or videos (or their grids)


def continuing(original: Callable, pin: Pin, rule: Deltas) -> Callable:
    """The wrapper's ``forward``, its calls without positions numbered by real tokens (module docstring)."""

    @functools.wraps(original)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if args or not patched_here(pin) or torch.compiler.is_compiling():
            return original(self, *args, **kwargs)  # (compiled: generate() passes its positions)
        if kwargs.get("position_ids") is not None:
            own = _own_rope_index(self, kwargs)  # (a packed row with images given 2-D positions)
            if own is not None:
                kwargs["position_ids"] = own
            return original(self, **kwargs)
        call = _call(kwargs)
        if call is None or (call.images and call.past):
            return original(self, **kwargs)
        real, past = call.real, call.past
        deltas = getattr(self, "rope_deltas", None)
        if call.images:  # an image prefill: stock's positions, each row's deltas from where it ends
            out = original(self, **kwargs)
            ends = _ends(self, kwargs, real)
            if ends is not None:
                self.rope_deltas = ends - (real.sum(-1, keepdim=True) if rule.by_real else real.shape[1])
            return out
        if past:
            if not isinstance(deltas, Tensor) or real.shape[0] % deltas.shape[0]:
                return original(self, **kwargs)  # (5.2+, a text conversation: the text model's patch)
            deltas = deltas.reshape(deltas.shape[0], -1)[:, :1].to(real.device)
            deltas = deltas.repeat_interleave(real.shape[0] // deltas.shape[0], dim=0)
            start = (call.seen if rule.by_real else past) + deltas  # each row's next position
        elif rule.numbers_text or isinstance(deltas, Tensor):  # a text prefill
            start = torch.zeros(real.shape[0], 1, dtype=torch.long, device=real.device)
        else:
            return original(self, **kwargs)  # (5.2+, a text conversation: the text model's patch)
        if past or rule.numbers_text:  # the real tokens before each new one, from the row's next position
            kwargs["position_ids"] = (start + real.cumsum(-1) - real)[None].expand(3, -1, -1)
        out = original(self, **kwargs)
        if rule.by_real:  # (its offset: the same all along, none in a text conversation)
            self.rope_deltas = deltas if past else torch.zeros_like(start)
        else:  # its next position less the cache's length: moved by this call's pads
            self.rope_deltas = start - past + real.sum(-1, keepdim=True) - real.shape[1]
        return out

    return forward


def _call(kwargs: dict) -> Optional[_Call]:
    """A call that gives no positions: its cache's length, where its new tokens are real, and whether it
    gives images; None for any other."""
    if kwargs.get("position_ids") is not None:
        return None
    tokens = kwargs.get("input_ids")
    if tokens is None:
        tokens = kwargs.get("inputs_embeds")
    if not isinstance(tokens, Tensor) or tokens.dim() < 2:
        return None
    rows, new = tokens.shape[0], tokens.shape[1]
    past = caches.past_length(passed(kwargs, CACHE_NAMES))
    images = any(kwargs.get(name) is not None for name in VISION)
    mask = kwargs.get("attention_mask")
    if isinstance(mask, Tensor) and mask.dim() == 2 and mask.shape[0] == rows and mask.shape[1] >= new:
        at = past if mask.shape[1] >= past + new else mask.shape[1] - new  # (a static cache's: its capacity)
        mask = mask.to(device=tokens.device, dtype=torch.long)
        return _Call(past, mask[:, at : at + new], mask[:, :at].sum(-1, keepdim=True), images)
    if mask is None:
        return _Call(past, torch.ones(rows, new, dtype=torch.long, device=tokens.device), past, images)
    return None


def _ends(model: Any, kwargs: dict, real: Tensor) -> Optional[Tensor]:
    """Each row's next position after an image prefill (``[rows, 1]``): its last real token's, plus one,
    from the wrapper's own ``get_rope_index`` given the call's arguments by name; None where it takes
    others (the wrapper's deltas stand)."""
    index = getattr(model, "get_rope_index", None)
    try:
        names = inspect.signature(index).parameters
        given = {name: kwargs[name] for name in names if kwargs.get(name) is not None}
        if "input_ids" not in given:
            return None
        with torch.no_grad():
            positions = index(**given)[0]
    except Exception:  # (a release whose index reads more than the call names: its deltas stand)
        return None
    if not isinstance(positions, Tensor) or positions.dim() != 3 or positions.shape[-1] != real.shape[1]:
        return None
    last = (real * torch.arange(1, real.shape[1] + 1, device=real.device)).argmax(-1, keepdim=True)
    at = last[None].expand(positions.shape[0], -1, -1).to(positions.device)
    return positions.gather(2, at).amax(0).to(real.device) + 1


def _own_rope_index(model: Any, kwargs: dict) -> Optional[Tensor]:
    """A row that packs sequences with images, given 2-D positions (a collator's: each sequence from 0):
    each sequence's own multimodal rope positions ``[3, rows, length]``, as the wrapper numbers it alone
    (its ``get_rope_index`` on its tokens, images and videos, taken in order); None for any other call
    (its positions stand: stock gives the image tokens text positions)."""
    positions, ids = kwargs.get("position_ids"), kwargs.get("input_ids")
    grids = {"image_grid_thw": kwargs.get("image_grid_thw"), "video_grid_thw": kwargs.get("video_grid_thw")}
    if not isinstance(positions, Tensor) or positions.dim() != 2 or not isinstance(ids, Tensor):
        return None
    if all(grid is None for grid in grids.values()) or positions.shape != ids.shape:
        return None
    mask = kwargs.get("attention_mask")
    mask = mask if isinstance(mask, Tensor) and mask.shape == ids.shape else None
    if not bool(restarts(positions, mask)):
        return None
    config = model.config
    tokens = {name: _id(config, f"{kind}_token_id") for name, kind in zip(grids, ("image", "video"))}
    merge = getattr(getattr(config, "vision_config", None), "spatial_merge_size", 1) ** 2
    try:
        names = inspect.signature(model.get_rope_index).parameters
        handled = {"input_ids", "attention_mask", "mm_token_type_ids", *grids}
        if any(kwargs.get(name) is not None for name in names if name not in handled):
            return None  # (what this cannot cut by sequence: Qwen2.5-VL's seconds per video grid)
        taken = {name: 0 for name in grids}
        own = torch.zeros(3, *ids.shape, dtype=torch.long, device=ids.device)
        for row, parts in enumerate(segments(positions, mask).tolist()):
            for part in dict.fromkeys(parts):
                cols = [i for i, p in enumerate(parts) if p == part]
                start, end = cols[0], cols[-1] + 1
                given = {"input_ids": ids[row : row + 1, start:end]}
                for name, grid in grids.items():
                    count = int((given["input_ids"] == tokens[name]).sum()) if grid is not None else 0
                    first = taken[name]
                    while count > 0:  # (each image's grid, in order, until its tokens are counted)
                        count -= int(grid[taken[name]].prod()) // merge
                        taken[name] += 1
                    if taken[name] > first:
                        given[name] = grid[first : taken[name]]
                for name in ("attention_mask", "mm_token_type_ids"):
                    if isinstance(kwargs.get(name), Tensor) and kwargs[name].shape == ids.shape:
                        given[name] = kwargs[name][row : row + 1, start:end]
                if any(name not in names for name in given):
                    return None
                with torch.no_grad():
                    own[:, row, start:end] = model.get_rope_index(**given)[0][:, 0].to(own.device)
    except Exception:  # (a release whose index takes more than this gives it: the positions stand)
        return None
    return own


def _id(config: Any, name: str) -> Optional[int]:
    value = getattr(config, name, None)
    return value if value is not None else getattr(getattr(config, "text_config", None), name, None)
