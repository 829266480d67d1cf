"""Bad input gets a clear ValueError naming the argument and what was expected, not a wrong answer."""

from __future__ import annotations

import contextlib

import pytest
import torch

import hfpatch

from conftest import static_cache_skip_reason
from harness import cache_kwarg, output_cache, random_rows, static_cache

pytestmark = pytest.mark.invariant("I7")  # compat/REPORT.md's column


def _prefix(model):
    (row,) = random_rows([4], seed=6)
    with torch.no_grad():
        out = model(input_ids=torch.tensor([row[:3]]), use_cache=True)
    return row, output_cache(out)


@pytest.mark.parametrize("columns", [1, 3, 5, 9])
def test_mask_length_must_be_past_plus_new(model, columns):
    row, cache = _prefix(model)
    with pytest.raises(ValueError, match=rf"attention_mask has {columns} columns.*expected 4"):
        model(
            input_ids=torch.tensor([row[3:]]),
            attention_mask=torch.ones(1, columns),
            **{cache_kwarg(model): cache},
        )


def test_mask_length_without_cache(model):
    with pytest.raises(ValueError, match="attention_mask has 5 columns.*expected 3"):
        model(input_ids=torch.tensor([[1, 2, 3]]), attention_mask=torch.ones(1, 5))


def test_mask_batch_must_match_inputs(model):
    with pytest.raises(ValueError, match="attention_mask has batch size 2, but the inputs have 1"):
        model(input_ids=torch.tensor([[1, 2, 3]]), attention_mask=torch.ones(2, 3))


@pytest.mark.parametrize("shape", [(1, 1, 3), (3,)])
def test_mask_must_be_2d_or_4d(model, shape):
    with pytest.raises(ValueError, match=r"attention_mask must be 2-D .* got shape"):
        model(input_ids=torch.tensor([[1, 2, 3]]), attention_mask=torch.ones(*shape))


def test_static_cache_mask_must_fit(model, arch):
    reason = static_cache_skip_reason(model)
    if reason:
        pytest.skip(reason)
    cache = static_cache(model, 1, 8)
    with pytest.raises(ValueError, match="attention_mask has 12 columns.*static cache has 8 slots"):
        model(
            input_ids=torch.tensor([[1, 2, 3]]),
            attention_mask=torch.ones(1, 12),
            **{cache_kwarg(model): cache},
        )


def test_explicit_position_ids_skip_the_mask_checks(model):
    """With position_ids given, hfpatch derives nothing from the mask, so it does not judge it either: a
    mask of the wrong length (a ValueError without position_ids, above) gets what stock does with it."""
    (row,) = random_rows([3], seed=6)
    kwargs = {
        "input_ids": torch.tensor([row]),
        "attention_mask": torch.ones(1, 5, dtype=torch.long),
        "position_ids": torch.arange(3)[None],
    }
    outcomes = []
    for context in (contextlib.nullcontext(), hfpatch.unpatched()):
        with context, torch.no_grad():
            try:
                outcomes.append(model(**kwargs).logits)
            except Exception as exc:  # noqa: BLE001 - stock's own behaviour, whatever it is
                outcomes.append(f"{type(exc).__name__}: {exc}")
    patched, stock = outcomes
    if isinstance(stock, str):
        assert patched == stock
    else:
        assert torch.equal(patched, stock)
