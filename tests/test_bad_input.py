"""A model call stock runs never raises because of hfpatch: where a mask (or a ``cache_position``) does
not fit the call, hfpatch cannot derive its positions, so the call runs as stock runs it (the same
result, or stock's own error), and a ``RuntimeWarning`` names the argument, once per model type."""

from __future__ import annotations

import contextlib
import warnings
from typing import Optional

import pytest
import torch

import hfpatch

from conftest import static_cache_skip_reason
from harness import cache_kwarg, output_cache, random_rows, static_cache

pytestmark = pytest.mark.invariant("I7")  # compat/REPORT.md's column


@pytest.fixture(autouse=True)
def _fresh(fresh_warnings):
    """hfpatch says once per process what it leaves to stock: said again in each test here."""


def _prefix(model):
    (row,) = random_rows([4], seed=6)
    with torch.no_grad():
        out = model(input_ids=torch.tensor([row[:3]]), use_cache=True)
    return row, output_cache(out)


def left_to_stock(model, make_kwargs, match: str, read=lambda out: out.logits) -> None:
    """The call, patched, warns (naming the argument) and gets stock's result or stock's own error
    (``read``: the tensor of its output compared)."""
    outcomes = []
    for patched in (True, False):
        with contextlib.ExitStack() as stack, torch.no_grad():
            if patched:
                stack.enter_context(pytest.warns(RuntimeWarning, match=match))
            else:
                stack.enter_context(hfpatch.unpatched())
            try:
                outcomes.append(read(model(**make_kwargs())))
            except Exception as exc:  # noqa: BLE001 - stock's own behaviour, whatever it is
                outcomes.append(f"{type(exc).__name__}: {exc}")
    patched, stock = outcomes
    assert type(patched) is type(stock), outcomes
    assert patched == stock if isinstance(stock, str) else torch.equal(patched, stock)


@pytest.mark.parametrize("columns", [1, 3, 5, 9])
def test_mask_length_must_be_past_plus_new(model, columns):
    row, _ = _prefix(model)

    def kwargs():
        return {"input_ids": torch.tensor([row[3:]]), "attention_mask": torch.ones(1, columns),
                cache_kwarg(model): _prefix(model)[1]}  # fmt: skip

    left_to_stock(model, kwargs, rf"attention_mask has {columns} columns.*expected 4")


def test_mask_length_without_cache(model):
    """A mask wider than the call, no cache (transformers' own Moonshine test hands its decoder the
    encoder's mask so): stock runs it."""
    left_to_stock(
        model,
        lambda: {"input_ids": torch.tensor([[1, 2, 3]]), "attention_mask": torch.ones(1, 5)},
        "attention_mask has 5 columns.*expected 3",
    )


def test_mask_batch_must_match_inputs(model):
    left_to_stock(
        model,
        lambda: {"input_ids": torch.tensor([[1, 2, 3]]), "attention_mask": torch.ones(2, 3)},
        "attention_mask has batch size 2, but the inputs have 1",
    )


@pytest.mark.parametrize("shape", [(1, 1, 3), (3,)])
def test_mask_must_be_2d_or_4d(model, shape):
    left_to_stock(
        model,
        lambda: {"input_ids": torch.tensor([[1, 2, 3]]), "attention_mask": torch.ones(*shape)},
        r"attention_mask must be 2-D .* got shape",
    )


def test_static_cache_mask_must_fit(model, arch):
    reason = static_cache_skip_reason(model)
    if reason:
        pytest.skip(reason)
    left_to_stock(
        model,
        lambda: {
            "input_ids": torch.tensor([[1, 2, 3]]),
            "attention_mask": torch.ones(1, 12),
            cache_kwarg(model): static_cache(model, 1, 8),
        },  # fmt: skip
        "attention_mask has 12 columns.*static cache has 8 slots",
    )


def _outcome(model, kwargs) -> Optional[str]:
    """None where the call runs, else its error (a mask of the wrong width: 4.x GPT-2 raises on stock)."""
    try:
        with torch.no_grad():
            model(**kwargs)
    except Exception as exc:  # noqa: BLE001 - stock's own behaviour, whatever it is
        return f"{type(exc).__name__}: {exc}"
    return None


def test_said_once_per_model_type_and_argument(model):
    """A mask of the wrong width is left to stock (its result, or its own error), with one warning per
    model type and argument."""
    kwargs = {"input_ids": torch.tensor([[1, 2, 3]]), "attention_mask": torch.ones(1, 5)}
    wider = {**kwargs, "attention_mask": torch.ones(1, 7)}
    with hfpatch.unpatched(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = [_outcome(model, kwargs), _outcome(model, wider)]
    with pytest.warns(RuntimeWarning, match="attention_mask"):
        assert _outcome(model, kwargs) == expected[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert [_outcome(model, kwargs), _outcome(model, wider)] == expected


def test_explicit_position_ids_skip_the_mask_checks(model):
    """With position_ids given, hfpatch derives nothing from the mask, so it does not judge it either: a
    mask of the wrong length gets what stock does with it, without a word."""
    (row,) = random_rows([3], seed=6)
    kwargs = {
        "input_ids": torch.tensor([row]),
        "attention_mask": torch.ones(1, 5, dtype=torch.long),
        "position_ids": torch.arange(3)[None],
    }
    outcomes = []
    for context in (contextlib.nullcontext(), hfpatch.unpatched()):
        with context, torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            try:
                outcomes.append(model(**kwargs).logits)
            except Exception as exc:  # noqa: BLE001 - stock's own behaviour, whatever it is
                outcomes.append(f"{type(exc).__name__}: {exc}")
    patched, stock = outcomes
    if isinstance(stock, str):
        assert patched == stock
    else:
        assert torch.equal(patched, stock)
