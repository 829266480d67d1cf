"""Rope scaled per sequence: ``longrope`` and dynamic NTK choose their scaling from a sequence's own
largest position, not from the whole batch's.

transformers (4.51+) wraps every rotary class's ``forward`` in ``dynamic_rope_update``, which reads
``max(position_ids)`` over the whole batch: a short row batched with a row past the original context
is rotated with the long row's factors (longrope), or its NTK frequencies (dynamic), and its logits
differ from the row run alone; so is a short sequence packed into one row with a long one (positions
restarting, or an unpadded call's packed row). The classes are found by that decorator's code object,
never by name; their ``forward`` is replaced while their model's adapter is patched. For a rope type
whose scaling does not depend on the length, the replacement calls the original at once.

The rule, for one call and across cached calls: each sequence's new tokens are rotated with the factors
that sequence alone would get in the same call, chosen from its own largest position (its cached real
tokens plus its new ones, or the caller's explicit ``position_ids``). A row's sequences are its runs of
positions (:func:`hfpatch.positions.segments`: a row of one sequence unless its positions restart; with
``apply(packed=False)`` every row is one). Keys already cached keep the
rotation they were written with, as on stock: a row that crosses the original context between calls
differs from itself run in one call, on stock too (the reference is the row alone, same calls).

- longrope: two calls of the undecorated forward, short and long factors, the long sequences' positions
  zeroed in the first and one column at the threshold added to the second (so that a body that reads
  the batch's largest position itself, 5.x PhiMoE's, decides as each sequence would); each token takes
  its sequence's.
- dynamic: each sequence's frequencies from the release's own NTK function at its own length (it takes a
  tensor length from 4.56): in one call where the body broadcasts ``position_ids[..., None] *
  inv_freq`` (5.19+), else one call per row and, in eager mode, per sequence past the original context
  in a row that packs several (compiled code there: the row's longest, a documented limit).

The undecorated forward reads the frequencies from the module, so they are swapped in for the call,
under a lock in eager mode (another thread on the same module waits instead of reading them), and put
back. Compile-safe: no ``.item()``, no branch on tensor values.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, NamedTuple, Optional

import torch

from ._compat import modeling_rope_utils
from ._context import PACKED, Users
from .positions import segments
from .sources import source_of

__all__ = [
    "DYNAMIC",
    "LONGROPE",
    "Rotary",
    "per_row_forward",
    "per_row_scaling",
    "rotary_classes",
    "scaled_rope",
    "scaled_rope_kind",
]

LONGROPE, DYNAMIC = "longrope", "dynamic"
_LOCK = threading.RLock()  # around a swap of a module's frequencies (eager mode)
_TENSOR_NTK: dict = {}  # whether the release's NTK function takes a tensor length (4.56+), read once


def scaled_rope_kind(rope_type: Any) -> Optional[str]:
    """``longrope``, ``dynamic`` (any rope type with it in its name, as transformers tests it), or None."""
    if not isinstance(rope_type, str):
        return None
    if rope_type == LONGROPE:
        return LONGROPE
    return DYNAMIC if "dynamic" in rope_type else None


def scaled_rope(model: Any) -> Optional[tuple[str, int]]:
    """(kind, original context) of the first rotary module of ``model`` whose scaling depends on the
    length, or None."""
    for module in model.modules():
        rope_type = getattr(module, "rope_type", None)
        for name in rope_type.values() if isinstance(rope_type, dict) else [rope_type]:
            kind = scaled_rope_kind(name)
            if kind == LONGROPE and hasattr(module, "config"):
                return kind, _longrope_threshold(module, None)
            if kind == DYNAMIC and isinstance(getattr(module, "original_max_seq_len", None), int):
                return kind, module.original_max_seq_len
    return None


def per_row_scaling(kind: str) -> bool:
    """Whether hfpatch scales this kind of rope per row on the installed release: rotary classes wrapped
    in ``dynamic_rope_update`` (4.51+), and for dynamic NTK a function that takes tensor lengths (4.56+)."""
    return _decorator_code() is not None and (kind != DYNAMIC or _ntk_takes_tensors())


class Rotary(NamedTuple):
    """A rotary class whose ``forward`` transformers wraps in ``dynamic_rope_update``."""

    cls: type
    forward: Callable  # the class's own forward (what is replaced)
    stock: Callable  # ``dynamic_rope_update``'s wrapper: the batch's scaling (transformers')
    raw: Callable  # the undecorated forward under it
    no_grad: Optional[bool]  # above the wrapper: nothing (False), ``torch.no_grad()`` (True), else None


def rotary_classes(module: Any) -> list[Rotary]:
    """Every rotary class defined in ``module`` whose ``forward`` transformers wraps in
    ``dynamic_rope_update`` (on 4.x under ``torch.no_grad()``)."""
    code = _decorator_code()
    if code is None:  # before 4.51: no such wrapper, and the rope is the batch's (a declared limit)
        return []
    found = []
    for value in list(vars(module).values()):
        if not (isinstance(value, type) and value.__module__ == module.__name__):
            continue
        original = vars(value).get("forward")
        above, wrapper = [], original
        while wrapper is not None and getattr(wrapper, "__code__", None) is not code and len(above) < 8:
            above.append(wrapper)
            wrapper = getattr(wrapper, "__wrapped__", None)
        if wrapper is None or getattr(wrapper, "__code__", None) is not code:
            continue
        no_grad = False if not above else _is_no_grad(above[0]) if len(above) == 1 else None
        found.append(Rotary(value, original, wrapper, wrapper.__wrapped__, no_grad))
    return found


def _is_no_grad(function: Any) -> Optional[bool]:
    """True for a function decorated with ``torch.no_grad()``; None for any other decorator."""
    code = torch.no_grad()(lambda: None).__code__
    if getattr(function, "__code__", None) is not code:
        return None
    cells = dict(zip(function.__code__.co_freevars, function.__closure__ or ()))
    factory = getattr(cells.get("ctx_factory"), "cell_contents", None)
    return True if isinstance(getattr(factory, "__self__", None), torch.no_grad) else None


def per_row_forward(rotary: Rotary, users: Users) -> Callable:
    """The replacement rotary ``forward``: per-row scaling for longrope and dynamic NTK in a call where
    an adapter of its module (``users``) is patched (compiled code alike), transformers' own scaling
    otherwise. It takes the place of transformers' ``dynamic_rope_update`` wrapper (under the same
    ``torch.no_grad()`` where the release has one): for a rope type whose scaling does not depend on the
    length it calls the undecorated forward, as that wrapper does, so a call pays no extra frame. Above
    any other decorator, it wraps the class's forward instead."""
    known = rotary.no_grad is not None
    unscaled = rotary.raw if known else rotary.forward
    stock = rotary.stock if known else rotary.forward
    scaled = _scaled_forward(stock, rotary.raw, users)

    @functools.wraps(rotary.forward)
    def forward(self: Any, x: torch.Tensor, position_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        rope_type = self.rope_type
        if not args and not kwargs and rope_type.__class__ is str and rope_type != "longrope":
            if "dynamic" not in rope_type:  # most calls
                return unscaled(self, x, position_ids)
        return scaled(self, x, position_ids, args, kwargs)

    replacement = torch.no_grad()(forward) if rotary.no_grad else forward
    replacement.__hfpatch_rope__ = True  # type: ignore[attr-defined]
    return replacement


def _scaled_forward(stock: Callable, raw: Callable, users: Users) -> Callable:
    """A rotary call that may be scaled: per row where hfpatch applies, ``stock`` otherwise."""
    broadcasts = _broadcasts(raw)  # read once, here: inspect cannot run under dynamo
    ntk_takes_tensors = _ntk_takes_tensors()

    def scaled(self: Any, x: torch.Tensor, position_ids: torch.Tensor, args: tuple, kwargs: dict) -> Any:
        layer_type = kwargs.get("layer_type", args[0] if args else None)
        rope_type = self.rope_type if layer_type is None else self.rope_type[layer_type]
        kind = scaled_rope_kind(rope_type)
        if kind is None or (kind == DYNAMIC and not ntk_takes_tensors):
            return stock(self, x, position_ids, *args, **kwargs)
        if not users.any_patched_here():  # (compiled code too: dynamo guards on the pins)
            return stock(self, x, position_ids, *args, **kwargs)
        lengths = _sequence_lengths(position_ids)  # [batch, new]: each token's sequence's
        prefix = "" if layer_type is None else f"{layer_type}_"
        short = getattr(self, f"{prefix}original_inv_freq").to(x.device)
        if kind == LONGROPE:
            threshold = _longrope_threshold(self, layer_type)
            long = _long_inv_freq(self, rope_type, threshold, layer_type, x.device)
            return _longrope(self, raw, x, position_ids, lengths > threshold, short, long, threshold, prefix,
                             args, kwargs)  # fmt: skip
        init = _init_function(self, rope_type)
        extra = {} if layer_type is None else {"layer_type": layer_type}

        def frequencies(seq_len: torch.Tensor) -> torch.Tensor:  # [...] -> [..., dim/2]
            ntk, _ = init(self.config, x.device, seq_len=seq_len[..., None], **extra)
            return torch.where((seq_len > self.original_max_seq_len)[..., None], ntk, short)

        if broadcasts:  # one call: [batch, new, dim/2] frequencies against [batch, new] positions
            tokens = frequencies(lengths)
            return _call_with(self, f"{prefix}inv_freq", tokens, raw, x, position_ids, args, kwargs)
        return _dynamic(self, raw, x, position_ids, lengths, frequencies, prefix, args, kwargs)

    return scaled


def _longrope(
    module: Any, raw: Callable, x: torch.Tensor, position_ids: torch.Tensor, long_tokens: torch.Tensor,
    short: torch.Tensor, long: torch.Tensor, threshold: int, prefix: str, args: tuple, kwargs: dict,
) -> Any:  # fmt: skip
    short_positions = torch.where(long_tokens, 0, position_ids)  # [batch, new] vs [(3,) batch, new]
    extra = position_ids.new_full((*position_ids.shape[:-1], 1), threshold)
    long_positions = torch.cat([position_ids, extra], dim=-1)
    locked = _lock()
    try:
        out_short = _call_with(module, f"{prefix}inv_freq", short, raw, x, short_positions, args, kwargs)
        out_long = _call_with(module, f"{prefix}inv_freq", long, raw, x, long_positions, args, kwargs)
    finally:
        _unlock(locked)
    return _per_token(long_tokens, out_long, out_short)


def _dynamic(
    module: Any, raw: Callable, x: torch.Tensor, position_ids: torch.Tensor, lengths: torch.Tensor,
    frequencies: Callable[[torch.Tensor], torch.Tensor], prefix: str, args: tuple, kwargs: dict,
) -> Any:  # fmt: skip
    """A body that takes one ``[dim/2]`` frequency vector a call (before 5.19): one call per row at its
    longest sequence's length; in eager mode, a row whose sequences differ in scaling gets one call per
    length past the original context besides its short one, each token taking its sequence's."""
    name = f"{prefix}inv_freq"
    eager = not torch.compiler.is_compiling() and lengths.shape[-1] > 1  # (one token: one sequence a row)
    locked = _lock()
    try:
        pieces = []
        for b in range(lengths.shape[0]):
            row = position_ids[..., b : b + 1, :]
            longest = lengths[b].amax()
            out = _call_with(module, name, frequencies(longest), raw, x, row, args, kwargs)
            if eager and bool(lengths[b].amin() != longest) and bool(longest > module.original_max_seq_len):
                out = _call_with(module, name, frequencies(lengths[b].amin()), raw, x, row, args, kwargs)
                for length in torch.unique(lengths[b]).tolist():  # (a packed row: a host read, eager only)
                    if length > module.original_max_seq_len:
                        length = lengths.new_tensor(length)
                        mine = (lengths[b : b + 1] == length)[..., None]  # [1, new, 1]
                        out = _per_token(mine, _call_with(module, name, frequencies(length), raw, x, row,
                                                          args, kwargs), out)  # fmt: skip
            pieces.append(out)
    finally:
        _unlock(locked)
    if isinstance(pieces[0], (tuple, list)):
        return type(pieces[0])(torch.cat(parts, dim=-3) for parts in zip(*pieces))
    return torch.cat(pieces, dim=-3)


def _call_with(
    module: Any, name: str, inv_freq: torch.Tensor, raw: Callable, x: torch.Tensor, positions: torch.Tensor,
    args: tuple, kwargs: dict,
) -> Any:  # fmt: skip
    """``raw`` with the module's frequencies ``name`` set to ``inv_freq`` for the call, then put back."""
    saved = getattr(module, name)
    setattr(module, name, inv_freq + 0)  # a fresh tensor: dynamo will not rebind a buffer to another
    try:
        return raw(module, x, positions, *args, **kwargs)
    finally:
        setattr(module, name, saved)


def _lock() -> bool:
    """Take the lock around a swap of a module's frequencies, in eager mode (a lock cannot be traced;
    compiled code is called from one thread at a time per graph)."""
    if torch.compiler.is_compiling():
        return False
    _LOCK.acquire()
    return True


def _unlock(locked: bool) -> None:
    if locked:
        _LOCK.release()


def _per_token(tokens: torch.Tensor, when_true: Any, when_false: Any) -> Any:
    """Per token, ``when_true`` (trimmed to ``when_false``'s length) where ``tokens`` ``[batch, new]`` (or
    ``[batch, new, 1]``), else ``when_false`` (``[..., batch, new, dim]``, or a tuple of such)."""
    if isinstance(when_true, (tuple, list)):
        return type(when_true)(_per_token(tokens, a, b) for a, b in zip(when_true, when_false))
    when_true = when_true[..., : when_false.shape[-2], :]
    shape = [1] * when_false.dim()
    shape[-3:-1] = tokens.shape[:2]
    return torch.where(tokens.reshape(shape), when_true, when_false)


def _sequence_lengths(position_ids: torch.Tensor) -> torch.Tensor:
    """Each token's sequence's largest position + 1, ``[batch, new]``, from ``[batch, new]`` or
    ``[sections, batch, new]`` positions: a row's sequences are its runs of positions (a row is one
    where they never restart, or where packed rows are left to stock)."""
    positions = position_ids
    while positions.dim() > 2:
        positions = positions.amax(0)
    if not PACKED[0] or positions.shape[-1] == 1:  # (one token a row, a decode step: nothing restarts)
        return (positions.amax(-1, keepdim=True) + 1).expand_as(positions)
    ids = segments(position_ids)  # [batch, new], from 0
    largest = torch.full_like(positions, -1).scatter_reduce(-1, ids, positions, "amax")
    return largest.gather(-1, ids) + 1


def _longrope_threshold(module: Any, layer_type: Optional[str]) -> int:
    """The original context, read where the release reads it (5.x ``rope_parameters``, 4.x config)."""
    config = module.config
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict):
        params = params.get(layer_type, params) if layer_type is not None else params
        if params.get("original_max_position_embeddings") is not None:
            return int(params["original_max_position_embeddings"])
    value = getattr(config, "original_max_position_embeddings", None)
    return int(value) if value else int(config.max_position_embeddings)


def _init_function(module: Any, rope_type: str) -> Callable:
    function = getattr(module, "rope_init_fn", None)  # 4.51-4.57
    return function if function is not None else modeling_rope_utils.ROPE_INIT_FUNCTIONS[rope_type]


def _long_inv_freq(
    module: Any, rope_type: str, threshold: int, layer_type: Optional[str], device: Any
) -> Any:
    """longrope's long factors (kept on the module once computed, in eager mode)."""
    name = "_hfpatch_long_inv_freq" + ("" if layer_type is None else f"_{layer_type}")
    cached = module.__dict__.get(name)
    if cached is None:
        extra = {} if layer_type is None else {"layer_type": layer_type}
        cached, _ = _init_function(module, rope_type)(module.config, device, seq_len=threshold + 1, **extra)
        if not torch.compiler.is_compiling():
            module.__dict__[name] = cached
    return cached.to(device)


def _decorator_code() -> Any:
    decorator = getattr(modeling_rope_utils, "dynamic_rope_update", None)
    return None if decorator is None else decorator(lambda self, x, position_ids: None).__code__


@functools.cache
def _broadcasts(raw: Callable) -> bool:
    """The body multiplies ``position_ids[..., None]`` by the frequencies (5.19+): a ``[batch, 1, dim/2]``
    attribute gives per-row frequencies in one call. Earlier bodies expand them to the batch."""
    source = source_of(raw)
    if source is None:
        return False
    return "position_ids[..., None]" in source and "[None, :, None]" not in source


def _ntk_takes_tensors() -> bool:
    """The release's NTK function takes a tensor length (4.56+; before, it branches on it in Python)."""
    if "known" not in _TENSOR_NTK:
        source = source_of(modeling_rope_utils._compute_dynamic_ntk_parameters)
        _TENSOR_NTK["known"] = source is not None and "torch.maximum" in source
    return _TENSOR_NTK["known"]
