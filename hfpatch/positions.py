"""Pure tensor functions that derive positions from an attention mask and a cache length.

Everything here is a small function of tensors and shapes, safe under ``torch.compile(fullgraph=True)``:
no ``.item()``, no ``int(tensor)``, no Python branch on tensor values. Call them from your own decode
loops too.

Terms, as in transformers:

- ``attention_mask``: ``[batch, past + new]``, 1 for real tokens, 0 for pads. Column ``j`` is cache slot
  ``j`` (a padded cached prefix leaves holes of zeros in the middle of a row).
- *position*: the index of a token among the real tokens of its row (what ``position_ids`` carry into
  the position embedding or RoPE).
- *slot*: the index of a token in the KV cache, shared by the whole batch (what ``cache_position``
  carries). Slots count pads, positions do not.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

import torch

__all__ = [
    "cache_positions",
    "call_inputs",
    "has_holes",
    "has_padding",
    "padded_on_host",
    "keys_seen",
    "new_token_positions",
    "packed_stock_error",
    "positions_from_mask",
    "positions_in_segments",
    "restarts",
    "segments",
    "segments_from_lengths",
    "sequence_lengths",
    "static_fill_level",
    "stock_error",
    "window_mask",
]


def call_inputs(kwargs: dict, rank: int = 2) -> Optional[torch.Tensor]:
    """A call's inputs, from its arguments by name (the one place hfpatch reads them): ``input_ids``
    ``[batch, new]`` (``rank`` 3: audio codes ``[batch, new, channels]``), else ``inputs_embeds``
    ``[batch, new, hidden]``; ``None`` for none (transformers raises its own error) or inputs of another
    shape (GPT-2's multiple choice ``[batch, choices, tokens]``: stock's)."""
    tokens = kwargs.get("input_ids")
    if tokens is None:
        tokens, rank = kwargs.get("inputs_embeds"), 3
    return tokens if isinstance(tokens, torch.Tensor) and tokens.dim() == rank else None


def padded_on_host(kwargs: dict, *alongside: torch.Tensor) -> Optional[torch.Tensor]:
    """A call whose 2-D mask is as wide as its tokens (ids, or embeddings) and has a pad: the mask (1 real,
    0 pad) and each of ``alongside`` (``[batch, length]`` tensors), as int64 ``[1 + len(alongside), batch,
    length]``, read to the host in one copy (the call's one host read); None for any other call, and in
    compiled code (nothing read).

    Example:
        >>> padded_on_host({"input_ids": torch.ones(1, 3), "attention_mask": torch.tensor([[1, 1, 0]])})
        tensor([[[1, 1, 0]]])
    """
    mask, ids = kwargs.get("attention_mask"), kwargs.get("input_ids")
    if ids is None:
        ids = kwargs.get("inputs_embeds")
    if mask.__class__ is not torch.Tensor or mask.dim() != 2 or not isinstance(ids, torch.Tensor):
        return None
    if ids.dim() < 2 or tuple(mask.shape) != tuple(ids.shape[:2]) or torch.compiler.is_compiling():
        return None
    rows = [(mask != 0).long(), *(row.long().expand(mask.shape) for row in alongside)]
    host = torch.stack(rows).cpu()
    return None if bool(host[0].all()) else host


def has_padding(kwargs: dict) -> bool:
    """A 2-D mask as wide as the call's tokens, with a pad (:func:`padded_on_host`: one read)."""
    return padded_on_host(kwargs) is not None


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position of every column of a 2-D mask: ``cumsum - 1`` over real tokens.

    A pad gets the position of the last real token before it in its row (0 if none): its own
    position never matters (it is masked out), and this way pads never raise ``position_ids.max()``
    above the real tokens' (rope variants such as dynamic NTK and longrope read it).

    Args:
        attention_mask: ``[batch, length]``, any dtype, 1 (or True) for real tokens, 0 for pads.

    Returns:
        ``[batch, length]`` int64.

    Example:
        >>> positions_from_mask(torch.tensor([[0, 0, 1, 1, 1], [1, 1, 0, 1, 0]]))
        tensor([[0, 0, 0, 1, 2],
                [0, 1, 1, 2, 2]])
    """
    return (attention_mask != 0).cumsum(-1).sub_(1).clamp_(min=0)


def new_token_positions(
    attention_mask: torch.Tensor,
    num_new: int,
    slots: Optional[Union[int, torch.Tensor]] = None,
) -> torch.Tensor:
    """Positions of the ``num_new`` tokens of this call, from a mask that spans past and new tokens:
    the same numbers as :func:`positions_from_mask` at their columns, in fewer kernels (this runs at
    every decode step).

    Args:
        attention_mask: ``[batch, length]``; columns are cache slots.
        num_new: number of tokens in this call (``input_ids.shape[1]``).
        slots: where the new tokens sit in the mask. ``None``: the last ``num_new`` columns (the usual
            mask of length past + new). An ``int``: the first new column. A 1-D int64 tensor of
            ``num_new`` column indices (a ``cache_position``), for a mask that spans a whole static
            cache.

    Returns:
        ``[batch, num_new]`` int64, contiguous (a fresh tensor, so strides stay the same from call to
        call under ``torch.compile``).

    Example:
        A right-padded cached prefix ``[a b c <pad>]`` continued by one token ``d``:

        >>> mask = torch.tensor([[1, 1, 1, 0, 1]])
        >>> new_token_positions(mask, 1)
        tensor([[3]])
    """
    real = attention_mask.ne(0)
    if slots is None and num_new == 1:  # a decode step, mask of past + new: the row's real tokens, less one
        return real.sum(-1, keepdim=True).sub_(1).clamp_(min=0)
    if isinstance(slots, torch.Tensor):  # columns given by index (a full-length static-cache mask)
        index = slots if slots.dim() == 1 else slots.reshape(-1)
        index = index if index.device == real.device else index.to(real.device)
        count = real.cumsum(-1).index_select(1, index)
    else:  # real tokens up to each new column: a sum for a decode step, else the ones before + a cumsum
        start = attention_mask.shape[1] - num_new if slots is None else slots
        if num_new == 1:
            count = (real if start + 1 == real.shape[1] else real[:, : start + 1]).sum(-1, keepdim=True)
        else:
            count = real[:, :start].sum(-1, keepdim=True) + real[:, start : start + num_new].cumsum(-1)
    return count.sub_(1).clamp_(min=0)


def has_holes(attention_mask: torch.Tensor) -> torch.Tensor:
    """Whether some row of a 2-D mask has a pad between two of its real tokens (a padded cached prefix
    continued, a ragged batch): the masks whose windows by cache column and by position differ.

    Returns:
        0-d bool tensor.

    Example:
        >>> has_holes(torch.tensor([[0, 1, 1], [1, 1, 0]])), has_holes(torch.tensor([[1, 0, 1]]))
        (tensor(False), tensor(True))
    """
    real = attention_mask != 0
    before = real.cumsum(-1)  # real tokens up to each column
    return (~real & (before > 0) & (before < before[:, -1:])).any()


def cache_positions(
    num_new: int, past: Union[int, torch.Tensor], device: Optional[torch.device] = None
) -> torch.Tensor:
    """Cache slots of ``num_new`` tokens written after ``past`` cached ones: ``arange(num_new) + past``.

    ``past`` may be a Python int or a 0-d/1-element tensor (a static cache's fill level). The form
    ``arange(n) + past`` (not ``arange(past, past + n)``) keeps a tensor ``past`` traceable.

    Example:
        >>> cache_positions(3, torch.tensor(5))
        tensor([5, 6, 7])
    """
    if isinstance(past, torch.Tensor):
        return torch.arange(num_new, device=past.device) + past.reshape(())
    return torch.arange(num_new, device=device) + past


def segments(position_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Which packed sequence each column of a row belongs to: a new one starts at a real token whose
    position is not the previous real token's + 1 (transformers' own rule,
    ``masking_utils.find_packed_sequence_indices``, which has no mask; here pads are skipped, so that the
    positions a padded batch is given, pads repeating a position, never split a row). Multimodal rope
    positions (Qwen-VL): the form ``[text; t; h; w]`` by its text row; the form ``[t; h; w]`` starts a
    sequence where all three are 0 (within one, an image keeps ``t`` while ``h`` and ``w`` run, and text
    goes on from the largest).

    Args:
        position_ids: ``[batch, length]``, the positions of a row that may pack several sequences (or
            ``[3 or 4, batch, length]``, multimodal rope positions).
        attention_mask: ``[batch, length]``, 1 for real tokens (None: every token is real).

    Returns:
        ``[batch, length]`` int64, 0 for the first sequence of each row, counting up (a pad counts with
        the real token before it).

    Example:
        >>> segments(torch.tensor([[0, 1, 2, 0, 1, 0]]))
        tensor([[0, 0, 0, 1, 1, 2]])
        >>> segments(torch.tensor([[0, 1, 2, 2, 0, 1]]), torch.tensor([[1, 1, 1, 0, 1, 1]]))
        tensor([[0, 0, 0, 0, 1, 1]])
    """
    return _starts(position_ids, attention_mask).cumsum(-1)


def restarts(position_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Whether some row's positions restart (a packed row: see :func:`segments`). 0-d bool tensor.

    Example:
        >>> restarts(torch.tensor([[0, 1, 2, 0, 1]]))
        tensor(True)
        >>> restarts(torch.tensor([[1, 1, 0, 1]]), torch.tensor([[0, 0, 1, 1]]))  # left padding
        tensor(False)
    """
    return _starts(position_ids, attention_mask).any()


def _starts(position_ids: torch.Tensor, attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """``[batch, length]`` bool: the real tokens that start a packed sequence after the row's first."""
    if position_ids.dim() == 3 and position_ids.shape[0] == 4:  # [text; t; h; w]: the text row says
        position_ids = position_ids[0]
    elif position_ids.dim() == 3:  # [t; h; w]: all three 0, after the row's first real token
        zero = (position_ids == 0).all(0)
        real = torch.ones_like(zero) if attention_mask is None else attention_mask != 0
        before = real.long().cumsum(-1) - real.long()  # real tokens before each column
        return real & zero & (before > 0)
    if attention_mask is None:
        starts = position_ids[:, 1:] != position_ids[:, :-1] + 1
        return torch.nn.functional.pad(starts, (1, 0))
    real = attention_mask != 0
    columns = torch.arange(real.shape[-1], device=real.device)
    last_real = torch.where(real, columns, -1).cummax(-1).values  # the last real column up to each
    before = torch.nn.functional.pad(last_real[:, :-1], (1, 0), value=-1)  # ... strictly before it
    previous = position_ids.expand_as(before).gather(-1, before.clamp(min=0))
    return real & (before >= 0) & (position_ids != previous + 1)


def segments_from_lengths(cu_seq_lens: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    """:func:`segments` of rows ``[batch, length]`` packed as ``cu_seq_lens`` says: the cumulative lengths
    of the sequences over the flattened rows, from 0 (``cu_seq_lens_q``, as
    ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` returns it). int64 ``[batch, length]``.

    Example:
        >>> segments_from_lengths(torch.tensor([0, 3, 5], dtype=torch.int32), 1, 5)
        tensor([[0, 0, 0, 1, 1]])
    """
    tokens = torch.arange(batch * length, device=cu_seq_lens.device)
    ends = cu_seq_lens[1:].to(torch.int64).contiguous()
    return torch.searchsorted(ends, tokens, right=True).reshape(batch, length)


def sequence_lengths(segment_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A packed batch's rows flattened into one, cut where a packed sequence starts and where real tokens
    and pads meet: the cumulative lengths of the pieces from 0 (``cu_seq_lens``, what flash attention's
    varlen kernel takes: every piece attended on its own), and how many sequences a pad splits (holes:
    those the pieces cannot give). Eager code: the number of pieces is read.

    Args:
        segment_ids: ``[batch or 1, length]``, :func:`segments` of the row.
        attention_mask: ``[batch, length]``, 1 for real tokens.

    Returns:
        (int32 ``[pieces + 1]``, an int).

    Example:
        >>> sequence_lengths(torch.tensor([[0, 0, 0, 1, 1, 1]]), torch.tensor([[1, 1, 1, 1, 1, 0]]))
        (tensor([0, 3, 5, 6], dtype=torch.int32), 0)
    """
    real = attention_mask != 0
    segment_ids = segment_ids.expand(real.shape)
    starts = torch.ones_like(real)
    starts[:, 1:] = (segment_ids[:, 1:] != segment_ids[:, :-1]) | (real[:, 1:] != real[:, :-1])
    flat = starts.reshape(-1).nonzero().squeeze(1)
    total = torch.tensor([real.numel()], device=flat.device)
    cu_seq_lens = torch.cat([flat, total]).to(torch.int32)
    real_pieces = int((starts & real).sum())
    sequences = int(torch.unique(segment_ids[real] + real.shape[1] * real.nonzero()[:, 0]).numel())
    return cu_seq_lens, real_pieces - sequences


def positions_in_segments(segment_ids: torch.Tensor) -> torch.Tensor:
    """Each column's position inside its packed sequence (0 at each sequence's first column), from a
    :func:`segments`-like ``[batch, length]`` tensor of sequence numbers (``seq_idx``). int64.

    Example:
        >>> positions_in_segments(torch.tensor([[0, 0, 0, 1, 1, 2]]))
        tensor([[0, 1, 2, 0, 1, 0]])
    """
    columns = torch.arange(segment_ids.shape[-1], device=segment_ids.device).expand_as(segment_ids)
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    first = torch.where(starts, columns, torch.zeros_like(columns)).cummax(-1).values
    return columns - first


def window_mask(
    attention_mask: torch.Tensor,
    query_slots: torch.Tensor,
    key_slots: torch.Tensor,
    window: Optional[int] = None,
    chunk: Optional[int] = None,
    *,
    positions: Optional[torch.Tensor] = None,
    segment_ids: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Which cache slots each new token attends to: :func:`keys_seen`'s rule rendered as a dense mask,
    decided by positions (not by slots, which count the holes of a padded cached prefix).

    A key is attended to when it is real, not after the query, in the query's packed sequence
    (``segment_ids``), and (``window``) less than ``window`` positions before it, or (``chunk``) in the
    same chunk of ``chunk`` positions. A pad query sees its own slot (so that no row of the mask is
    empty; its output is never read).

    Args:
        attention_mask: ``[batch, length]``, 1 for real tokens, spanning every slot below.
        query_slots: ``[new]`` int64, the new tokens' slots.
        key_slots: ``[keys]`` int64, the slots of the keys the layer attends to.
        positions: ``[batch or 1, length]``, each slot's position (the caller's ``position_ids``); default
            the mask's ``cumsum - 1``.
        segment_ids: ``[batch or 1, length]``, each slot's packed sequence (:func:`segments`); default one
            sequence a row.

    Returns:
        ``[batch, 1, new, keys]`` bool.

    Example:
        A right-padded prefix ``[a b <pad> <pad>]`` continued by ``c``, window 2: ``c`` sees ``b`` and itself.

        >>> window_mask(torch.tensor([[1, 1, 0, 0, 1]]), torch.tensor([4]), torch.arange(5), window=2).int()
        tensor([[[[0, 1, 0, 0, 1]]]], dtype=torch.int32)

        Two sequences packed in a row, ``[a b | c]``: ``c`` sees only itself.

        >>> window_mask(torch.ones(1, 3), torch.arange(3), torch.arange(3),
        ...             segment_ids=torch.tensor([[0, 0, 1]])).int()
        tensor([[[[1, 0, 0],
                  [1, 1, 0],
                  [0, 0, 1]]]], dtype=torch.int32)
    """
    seen = keys_seen(attention_mask, window, chunk, positions=positions, segment_ids=segment_ids)
    batch = torch.arange(attention_mask.shape[0], device=attention_mask.device)[:, None, None]
    return seen(batch, None, query_slots[None, :, None], key_slots[None, None, :])[:, None]


def keys_seen(
    attention_mask: torch.Tensor,
    window: Optional[int] = None,
    chunk: Optional[int] = None,
    *,
    positions: Optional[torch.Tensor] = None,
    segment_ids: Optional[torch.Tensor] = None,
) -> Callable[[Any, Any, Any, Any], torch.Tensor]:
    """The one rule of which keys a query may see, as a ``mask_mod(batch, head, query, key)`` over slot
    indices: a key is seen when it is real, not after the query, in the query's packed sequence
    (``segment_ids``), and (``window``) less than ``window`` positions before it, or (``chunk``) in the
    same chunk of ``chunk`` positions; a query always sees its own slot. Every mask hfpatch builds is a
    rendering of it: dense (:func:`window_mask`, indices that broadcast) or flex attention's
    ``BlockMask`` (:mod:`hfpatch.windows`, indices one at a time), as transformers' own mask functions
    are rendered. Arguments as :func:`window_mask`'s, over the same ``[batch, length]`` slots.

    Each part closes over one tensor: the CPU flex kernel of torch 2.13 fails to compile a ``mask_mod``
    that closes over several ("'cur_kvSplitSize' was not declared")."""
    real = attention_mask != 0
    rows = real.shape[0]
    parts = [_key_is(real)]
    if segment_ids is not None:
        parts.append(_same(segment_ids.expand(rows, -1).contiguous()))
    if window is not None or chunk is not None:
        position = real.cumsum(-1).sub_(1).clamp_(min=0) if positions is None else positions
        position = position.expand(rows, -1).contiguous()
        if window is not None:
            parts.append(_within(position, window))
        if chunk is not None:
            parts.append(_same(position.div(chunk, rounding_mode="floor")))

    def mask_mod(b: Any, head: Any, query: Any, key: Any) -> torch.Tensor:
        seen = key <= query
        for part in parts:
            seen = seen & part(b, query, key)
        return seen | (key == query)

    return mask_mod


def _key_is(real: torch.Tensor) -> Callable[[Any, Any, Any], torch.Tensor]:
    return lambda b, query, key: real[b, key]


def _same(values: torch.Tensor) -> Callable[[Any, Any, Any], torch.Tensor]:
    return lambda b, query, key: values[b, query] == values[b, key]


def _within(positions: torch.Tensor, window: int) -> Callable[[Any, Any, Any], torch.Tensor]:
    return lambda b, query, key: positions[b, query] - positions[b, key] < window


def static_fill_level(keys: torch.Tensor) -> torch.Tensor:
    """Number of filled slots of a static key buffer: one past the last slot any row or head wrote.

    transformers 4.39-5.3 guessed this with ``keys[0, 0].any(-1).sum()``, which under-counts when a
    cached key of row 0, head 0 is exactly zero (a zero embedding, transformers #30377, or a pad token
    whose embedding is zero). Taking the last non-zero slot over every row and head is wrong only if
    the newest slot is zero for the whole batch.

    Args:
        keys: ``[batch, heads, slots, head_dim]``.

    Returns:
        0-d int64 tensor.

    Example:
        >>> keys = torch.zeros(1, 1, 6, 2); keys[0, 0, 1:3] = 1.0   # slot 0 holds a zero key
        >>> static_fill_level(keys)
        tensor(3)
    """
    used = (keys != 0).any(-1).any(1).any(0)  # [slots]: written by some row and head
    slot_numbers = torch.arange(1, used.shape[0] + 1, device=keys.device)
    return (used.long() * slot_numbers).amax() if used.shape[0] else slot_numbers.sum()  # empty: 0


def stock_error(
    attention_mask: torch.Tensor,
    num_new: int,
    relative: bool,
    windows: Sequence[Optional[int]] = (),
    by_column: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Which real tokens of a call get other outputs on stock transformers than from positions by the
    mask, and how far their stock positions are off. Stock numbers the tokens by column
    (``arange(past, past + new)``), as it did in every earlier call of the cache; the reference numbers
    them as the row run alone, unpadded; ``by_column`` says otherwise where a call passed the positions
    the mask gives (as ``generate()`` does).

    Args:
        attention_mask: ``[batch, past + new]``; the call's tokens are its last ``num_new`` columns.
        relative: rotary positions or a relative bias (only distances matter: a row's leading pads shift
            every token alike; a pad after its first real token does not); else absolute positions (a
            pad before a token shifts it).
        windows: each layer's sliding window, in order (None: full attention). Stock's windows count
            columns, the reference's real tokens; a token is wrong where the keys it sees differ, their
            distances differ, or one of them is wrong (errors travel from layer to layer).
        by_column: ``[batch or 1, past + new]`` bool: whether each column's token was numbered by column
            (stock's own: a call without positions) or by the mask (False: a call that passed the mask's
            positions). Default: every column by column. With windows, every real column must be
            numbered alike (``ValueError`` otherwise).

    Returns:
        ``[batch, num_new]`` int64: 0 where stock is right (and at pads), else the pads before the token
        in its row (its stock position's shift). Eager code (with windows it loops over the layers).

    Example:
        A right-padded prefix ``[a b <pad>]`` continued by ``c``: wrong for both kinds of positions.

        >>> stock_error(torch.tensor([[1, 1, 0, 1], [1, 1, 1, 1]]), 1, relative=True)
        tensor([[1],
                [0]])
    """
    real = attention_mask != 0
    length = real.shape[-1]
    start = length - num_new
    if by_column is not None:  # columns numbered by column and by the mask
        return _numbered_error(real, by_column.expand_as(real), relative, windows)[:, start:]
    if all(window is None or window >= length for window in windows):  # every key in every window
        if num_new == 1:  # a decode step: the pads of the whole row
            pads = length - real.sum(-1, keepdim=True)
        else:  # pads up to each token
            pads = torch.arange(start + 1, length + 1, device=real.device) - real.cumsum(-1)[:, start:]
        if not relative:
            return pads * real[:, start:]
        # the row's leading pads (the index of its first real token) shift it all alike
        return pads * ((pads > real.int().argmax(-1, keepdim=True)) & real[:, start:])
    counts = real.cumsum(-1)  # real tokens in columns [0, t]
    columns = torch.arange(length, device=real.device)
    pads_before = columns + 1 - counts  # pads in columns [0, t]
    if not relative:  # the position table itself: shifted by every pad before the token
        state = (pads_before > 0) & real
    else:
        state = torch.zeros_like(real)
    kinds = list(windows) or [None]
    unchanged = 0  # layers in a row that changed nothing: a fixed point once every kind has had its turn
    for window in kinds:
        size = length if window is None else min(window, length)
        seen_ref = counts.clamp(max=size)  # the last `size` real tokens up to t
        lowest = (columns - size + 1).clamp_(min=0).expand_as(counts)
        seen_stock = counts - (counts - real.long()).gather(-1, lowest)  # real tokens in columns (t-size, t]
        first = torch.searchsorted(counts, (counts - seen_ref + 1).contiguous()).clamp_(max=length - 1)
        differs = seen_stock != seen_ref
        if relative:  # a pad between the first key seen and t: distances differ
            differs |= (columns - first + 1) != seen_ref
        wrong_so_far = state.long().cumsum(-1)
        keys_wrong = (wrong_so_far - (wrong_so_far - state.long()).gather(-1, first)) > 0
        after = (differs | keys_wrong) & real
        unchanged = unchanged + 1 if torch.equal(after, state) else 0
        state = after
        if unchanged >= len(set(kinds)):
            break
    return pads_before[:, start:] * state[:, start:]  # a wrong token has a pad before it


def _numbered_error(
    real: torch.Tensor, by_column: torch.Tensor, relative: bool, windows: Sequence[Optional[int]]
) -> torch.Tensor:
    """:func:`stock_error` where some columns were numbered by the mask (``by_column`` False): each
    column's stock position is off by its pads before it where numbered by column, else not at all. A
    token is wrong where the keys it sees differ (windows by column), its own position is off (absolute),
    a key it sees is off otherwise than it (relative: their distance), or a key it sees is wrong.
    ``[batch, length]`` int64: 0 where right, else how far off."""
    length = real.shape[-1]
    columns = torch.arange(length, device=real.device)
    counts = real.cumsum(-1)
    pads_before = columns + 1 - counts
    off = pads_before * by_column  # each column's stock position error
    by_col, by_mask = real & by_column, real & ~by_column
    col_counts, mask_counts = by_col.long().cumsum(-1), by_mask.long().cumsum(-1)

    def before(values: torch.Tensor, at: torch.Tensor) -> torch.Tensor:  # values[at - 1], 0 at column 0
        return torch.where(at > 0, values.gather(-1, (at - 1).clamp(min=0)), 0)

    state = (off > 0) & real if not relative else torch.zeros_like(real)
    kinds = list(windows) or [None]
    unchanged = 0
    for window in kinds:
        size = length if window is None else min(window, length)
        seen_ref = counts.clamp(max=size)
        lowest = (columns - size + 1).clamp_(min=0).expand_as(counts)
        seen_stock = counts - before(counts, lowest)
        first = torch.searchsorted(counts, (counts - seen_ref + 1).contiguous()).clamp_(max=length - 1)
        differs = seen_stock != seen_ref
        if relative:  # a key of the window numbered otherwise than t, or off by other pads
            masked_keys = mask_counts - before(mask_counts, first)
            column_keys = col_counts - before(col_counts, first)
            earliest = torch.searchsorted(col_counts, (before(col_counts, first) + 1).contiguous())
            latest = torch.searchsorted(col_counts, col_counts.contiguous())
            earliest_off = off.gather(-1, earliest.clamp_(max=length - 1))
            latest_off = off.gather(-1, latest.clamp_(max=length - 1))
            differs |= by_column & (
                ((masked_keys > 0) & (off > 0)) | ((column_keys > 0) & (earliest_off != off))
            )
            differs |= ~by_column & (column_keys > 0) & (latest_off > 0)
        wrong_so_far = state.long().cumsum(-1)
        keys_wrong = (wrong_so_far - before(wrong_so_far, first)) > 0
        after = (differs | keys_wrong) & real
        unchanged = unchanged + 1 if torch.equal(after, state) else 0
        state = after
        if unchanged >= len(set(kinds)):
            break
    spread = off.max(-1, keepdim=True).values  # how far apart the keys' positions can be
    return torch.maximum(off, spread).clamp(min=1) * state


def packed_stock_error(
    segment_ids: torch.Tensor, attention_mask: Optional[torch.Tensor], windows: Sequence[Optional[int]] = ()
) -> torch.Tensor:
    """Which real tokens of a packed batch (nothing cached before it) stock transformers gets wrong where
    its mask lets each sequence see the ones before it in its row: every real token of a sequence after
    the row's first, unless every layer has a sliding window (counted in columns) and the token is far
    enough from its sequence's start that none reaches back across it (each layer reaches its window
    less one further back: errors travel from layer to layer).

    Args:
        segment_ids: ``[batch, length]``, :func:`segments` of the call's positions and mask.
        attention_mask: ``[batch, length]`` (None: every token is real).
        windows: each layer's sliding window, in order (None: full attention).

    Returns:
        ``[batch, length]`` bool.

    Example:
        >>> packed_stock_error(torch.tensor([[0, 0, 0, 1, 1, 1]]), None)
        tensor([[False, False, False,  True,  True,  True]])
        >>> packed_stock_error(torch.tensor([[0, 0, 0, 1, 1, 1]]), None, windows=[2, 2])
        tensor([[False, False, False,  True,  True, False]])
    """
    real = torch.ones_like(segment_ids, dtype=torch.bool) if attention_mask is None else attention_mask != 0
    later = real & (segment_ids > 0)
    if not windows or any(window is None for window in windows):
        return later
    reach = sum(window - 1 for window in windows)
    return later & (positions_in_segments(segment_ids) < reach)
