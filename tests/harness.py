"""The tests' own harness: padded batches split into KV-cached calls, and the reference each real token
is held to, written here independently of hfpatch's ``verify`` (so that a bug there cannot hide a bug
in the patch). The random cases and their run against each row alone are ``compat/cases.py``'s (the
release matrix's case count draws the same).

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
from compat.cases import TOLERANCE, max_diff, random_case, run_alone, run_padded
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

WRONG = 1e-3  # a difference above this is a wrong result, not float noise
static_cache = new_static_cache  # StaticCache's constructor across releases
cache_kwarg = cache_name  # the cache argument's name: "cache" (5.24+), "past_key_values", or None


def random_rows(lengths: Sequence[int], seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=generator).tolist() for n in lengths]


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
