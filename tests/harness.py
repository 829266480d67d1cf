"""The tests' own harness: padded batches split into KV-cached calls, and the reference each real token
is held to, written here independently of hfpatch's ``verify`` (so that a bug there cannot hide a bug
in the patch). Also the random cases the property tests and the compat matrix's case count draw.

Reference: the same row run alone, unpadded, in one call, on stock transformers.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator, Sequence
from typing import Any, Optional

import torch

import hfpatch
from hfpatch._compat import cache_name, new_static_cache, output_cache
from hfpatch.verification.tiny import PAD, VOCAB

__all__ = [
    "PAD",
    "TOLERANCE",
    "VOCAB",
    "WRONG",
    "cache_kwarg",
    "max_diff",
    "noise_floor",
    "output_cache",
    "random_case",
    "random_rows",
    "run_alone",
    "run_padded",
    "static_cache",
    "tolerance_of",
    "worker_script",
]

TOLERANCE = 1e-5  # the invariant: every real token within this of its row run alone (fp32)
WRONG = 1e-3  # a difference above this is a wrong result, not float noise
static_cache = new_static_cache  # StaticCache's constructor across releases
cache_kwarg = cache_name  # the cache argument's name: "cache" (5.24+), "past_key_values", or None


def random_rows(lengths: Sequence[int], seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def run_alone(model: Any, tokens: Sequence[int]) -> torch.Tensor:
    """Logits ``[len(tokens), vocab]`` of one sequence, unpadded, in one call, on stock transformers."""
    with torch.no_grad(), hfpatch.unpatched():
        return model(input_ids=torch.tensor([list(tokens)])).logits[0]


def noise_floor(model: Any, rows: Sequence[Sequence[int]], pads: int = 3) -> float:
    """fp32's own noise at these lengths: the largest |logit difference| of each row run with ``pads`` pads
    after it (masked: nothing about its positions changes) from the row run alone, on stock. A model with
    large logits (scaled embeddings) has more of it than TOLERANCE allows."""
    worst = 0.0
    with torch.no_grad(), hfpatch.unpatched():
        for row in rows:
            ids = torch.tensor([list(row) + [PAD] * pads])
            mask = torch.tensor([[1] * len(row) + [0] * pads])
            padded = model(input_ids=ids, attention_mask=mask).logits[0, : len(row)]
            worst = max(worst, (padded - run_alone(model, row)).abs().max().item())
    return worst


def tolerance_of(model: Any, rows: Sequence[Sequence[int]]) -> float:
    """TOLERANCE, or four times the model's fp32 noise at these lengths where that is more (a wrong
    position or a leaked sequence is 1e-2 or more on these tiny models)."""
    return max(TOLERANCE, 4 * noise_floor(model, rows))


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


# For a subprocess (no tests on its path): transformers #18104 on a tiny model, written out by hand.
# ``error_18104(model_type)`` is the largest |logit difference| of a right-padded cached prefix
# continued by one token, against the row run alone; stock is wrong (gpt2: about 1.3), hfpatch exact.
SCRIPT_18104 = """
def error_18104(model_type):
    import torch
    from hfpatch.verification.tiny import tiny_model
    model = tiny_model(model_type)
    a, b = [5, 6, 7, 8], [9, 10, 11, 12, 13]
    with torch.no_grad():
        first = model(input_ids=torch.tensor([a[:3] + [0], b[:4]]),
                      attention_mask=torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]), use_cache=True)
        cache = first["cache"] if "cache" in first.keys() else first["past_key_values"]
        second = model(input_ids=torch.tensor([[a[3]], [b[4]]]),
                       attention_mask=torch.tensor([[1, 1, 1, 0, 1], [1, 1, 1, 1, 1]]), past_key_values=cache)
        alone = model(input_ids=torch.tensor([a])).logits[0, -1]
    return (second.logits[0, 0] - alone).abs().max().item()
"""


ORIGINAL_CONTEXT = 32  # the tiny scaled-rope models' original context: rows of 20 and 60 tokens cross it


def scaled_rope_model(model_type: str, kind: str, attention: Optional[str] = None, seed: int = 0) -> Any:
    """A tiny model of ``model_type`` whose rope scaling depends on the length: ``longrope`` (short and
    clearly different long factors, original context 32) or ``dynamic`` (NTK, factor 4, threshold 32),
    in the release's own config form (5.x ``rope_parameters``, 4.x ``rope_scaling``)."""
    import transformers
    from packaging.version import Version

    from hfpatch.verification.tiny import tiny_config

    config = tiny_config(model_type)
    fields = config.to_dict()
    for key in ("model_type", "transformers_version", "architectures", "_name_or_path"):
        fields.pop(key, None)
    five = Version(transformers.__version__) >= Version("5")
    half = (config.hidden_size // config.num_attention_heads) // 2
    if kind == "longrope":
        params = {
            "short_factor": [1.0 + 0.05 * i for i in range(half)],
            "long_factor": [1.0 + 1.5 * i for i in range(half)],
        }
        if model_type == "phimoe":
            params.update(short_mscale=1.0, long_mscale=1.6)
        fields.update(max_position_embeddings=128, original_max_position_embeddings=ORIGINAL_CONTEXT)
        if five:
            params.update(
                rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=ORIGINAL_CONTEXT
            )
        else:
            params["type"] = "longrope"
    else:
        params = {"factor": 4.0}
        fields["max_position_embeddings"] = ORIGINAL_CONTEXT  # dynamic NTK's threshold
        params.update(rope_type="dynamic", rope_theta=10000.0) if five else params.update(type="dynamic")
    fields["rope_parameters" if five else "rope_scaling"] = params
    config = type(config)(**fields)
    if attention is not None:
        config._attn_implementation = attention
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).float().eval()


def worker_script(model_type: str) -> str:
    """SCRIPT_18104 plus ``measure()``: a worker's own padded forward against the unpadded reference,
    its process id and ``hfpatch.status().applied_by`` (hfpatch is imported there, never applied)."""
    return (
        SCRIPT_18104
        + f"""
def measure():
    import os
    import hfpatch
    error = error_18104({model_type!r})
    return {{"pid": os.getpid(), "error": error, "applied_by": hfpatch.status().applied_by}}
"""
    )


@contextlib.contextmanager
def rotary_reading_row_zero(model: Any) -> Iterator[None]:
    """A fused rotary kernel's bug (Liger-Kernel #461) put into ``model``'s rotary embeddings, on the
    instances, for the block: every row gets row 0's positions. Skips where the rotary embedding takes
    no ``position_ids`` (before 4.38: it takes a length)."""
    import pytest

    found = [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]
    if not found or "position_ids" not in inspect.signature(found[0].forward).parameters:
        pytest.skip(f"{type(model).__name__}'s rotary embedding takes no position_ids here")

    def row_zero(forward: Any, x: Any, position_ids: Any, *args: Any, **kwargs: Any) -> Any:
        return forward(x, position_ids[:1].expand_as(position_ids), *args, **kwargs)

    for module in found:
        module.forward = functools.partial(row_zero, module.forward)
    try:
        yield
    finally:
        for module in found:
            del module.forward


def windowed_model(model_type: str, config: Any, attention: str) -> Any:
    """A tiny model of ``model_type`` from ``config`` (a sliding window or chunk set), fp32, eval mode,
    seed 0, with ``attention``; skips where the release runs no such attention for it, or decides its
    window by cache column (hfpatch leaves it to transformers there: verify() notes it)."""
    import pytest
    import transformers

    from hfpatch.windows import positional

    config._attn_implementation = attention
    torch.manual_seed(0)
    try:
        model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    except ValueError as exc:  # no SDPA for this model type on this release
        pytest.skip(f"{model_type} with {attention} attention in transformers {transformers.__version__}: "
                    f"{str(exc)[:150]}")  # fmt: skip
    if not positional(model, hfpatch.registry()[model_type].cls):
        pytest.skip(f"{model_type}'s window is decided by cache column in transformers "
                    f"{transformers.__version__}: left to it")  # fmt: skip
    return model
