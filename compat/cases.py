"""The random padded, KV-cached cases the property tests (``tests/``) and the release matrix's case count
(``compat/count_cases.py``) draw, and how they are run and judged: each row's real-token logits against
the row run alone, unpadded, in one call, on stock transformers. Written independently of hfpatch's
``verify``; ``tests/harness.py`` takes them from here."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch

import hfpatch
from hfpatch._compat import cache_name as cache_kwarg
from hfpatch._compat import output_cache
from hfpatch.verification.tiny import PAD, VOCAB

__all__ = ["TOLERANCE", "max_diff", "random_case", "run_alone", "run_padded"]

TOLERANCE = 1e-5  # the invariant: every real token within this of its row run alone (fp32)


def run_alone(model: Any, tokens: Sequence[int]) -> torch.Tensor:
    """Logits ``[len(tokens), vocab]`` of one sequence, unpadded, in one call, on stock transformers."""
    with torch.no_grad(), hfpatch.unpatched():
        return model(input_ids=torch.tensor([list(tokens)])).logits[0]


def max_diff(model: Any, rows: Sequence[Sequence[int]], got: Sequence[torch.Tensor]) -> float:
    """Largest |logit difference| at any real token between ``got`` and each row run alone."""
    return max((run_alone(model, row) - logits).abs().max().item() for row, logits in zip(rows, got))


def run_padded(
    model: Any,
    rows: Sequence[Sequence[int]],
    chunks: Sequence[Sequence[int]],
    left: Sequence[Sequence[bool]],
    cache: Any = None,
    mask_width: Optional[int] = None,
    pass_cache_position: bool = False,
    cache_name: Optional[str] = None,
    **extra: Any,
) -> list[torch.Tensor]:
    """Run ``rows`` as one padded batch, split into KV-cached calls; return each row's real-token logits.

    ``chunks[c][r]``: how many of row ``r``'s next tokens go into call ``c`` (0 allowed); ``left[c][r]``:
    pad row ``r`` on the left in call ``c`` (else on the right). ``cache``: the cache to start from;
    ``mask_width``: pad every mask with zeros to this many columns (a static cache's full length);
    ``pass_cache_position``: pass each call's slots explicitly; ``model`` may be any callable that
    takes the model's keyword arguments (then ``cache_name`` says what the cache is called).
    """
    name = cache_name or cache_kwarg(model)
    done = [0] * len(rows)
    columns: list[list[int]] = [[] for _ in rows]  # the whole mask so far, row by row
    logits: list[list[torch.Tensor]] = [[] for _ in rows]
    for counts, lefts in zip(chunks, left):
        width = max(counts)
        if width == 0:
            continue
        ids, real = [], []
        for r, (count, on_left) in enumerate(zip(counts, lefts)):
            tokens = list(rows[r][done[r] : done[r] + count])
            pads = [PAD] * (width - count)
            ids.append(pads + tokens if on_left else tokens + pads)
            real.append(range(width - count, width) if on_left else range(count))
            columns[r] += [1 if i in real[r] else 0 for i in range(width)]
            done[r] += count
        past = len(columns[0]) - width
        mask = torch.tensor([row + [0] * ((mask_width or len(row)) - len(row)) for row in columns])
        kwargs = dict(extra, input_ids=torch.tensor(ids), attention_mask=mask)
        if name is not None:
            kwargs.update({name: cache, "use_cache": True})
        if pass_cache_position:
            kwargs["cache_position"] = torch.arange(past, past + width)
        with torch.no_grad():
            out = model(**kwargs)
        returned = output_cache(out) if name is not None else None
        cache = returned if returned is not None else cache  # some releases return a new cache object
        for r in range(len(rows)):
            logits[r] += [out.logits[r, i] for i in real[r]]
    return [torch.stack(row) for row in logits]


def random_case(rng: Any, max_batch: int = 3, max_calls: int = 3, max_new: int = 4) -> tuple:
    """One random padded, KV-cached batch: ``(rows, chunks, left)`` for :func:`run_padded`. ``rng`` is a
    ``random.Random`` or a hypothesis ``draw``-backed object with the same ``randint``/``random``."""
    batch, calls = rng.randint(1, max_batch), rng.randint(1, max_calls)
    chunks = [[rng.randint(0, max_new) for _ in range(batch)] for _ in range(calls)]
    for r in range(batch):  # every row has at least one real token
        if sum(c[r] for c in chunks) == 0:
            chunks[0][r] = rng.randint(1, max_new)
    left = [[rng.random() < 0.5 for _ in range(batch)] for _ in range(calls)]
    rows = [[rng.randint(1, VOCAB - 1) for _ in range(sum(c[r] for c in chunks))] for r in range(batch)]
    return rows, chunks, left
