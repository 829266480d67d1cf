"""The reports hfpatch exists for, written out by hand: stock transformers is wrong, hfpatch is exact.

Reference everywhere: the same sequence run alone, unpadded, in one call (fp32, atol 1e-5).
"""

from __future__ import annotations

import pytest
import torch

from hfpatch.support import in_range
from hfpatch.verification.scenarios import SCENARIOS, scenario_rows

from conftest import TF, stock
from expectations import has_holes, left_padding_wrong_on_stock
from harness import (
    PAD,
    TOLERANCE,
    WRONG,
    cache_kwarg,
    max_diff,
    output_cache,
    random_rows,
    run_alone,
    run_padded,
)

pytestmark = pytest.mark.invariant("I1")  # compat/REPORT.md's column


def _18104(model):
    """transformers #18104: cache a right-padded batch of prefixes, then feed one more token per row."""
    a, b = random_rows([4, 5], seed=3)
    ids1 = torch.tensor([a[:3] + [PAD], b[:4]])
    mask1 = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    with torch.no_grad():
        out1 = model(input_ids=ids1, attention_mask=mask1, use_cache=True)
        mask2 = torch.cat([mask1, torch.ones(2, 1, dtype=torch.long)], dim=1)
        out2 = model(
            input_ids=torch.tensor([[a[3]], [b[4]]]),
            attention_mask=mask2,
            **{cache_kwarg(model): output_cache(out1)},
        )
    full_a, full_b = run_alone(model, a), run_alone(model, b)
    prefix_diff = max(
        (out1.logits[0, :3] - full_a[:3]).abs().max(), (out1.logits[1] - full_b[:4]).abs().max()
    )
    return (
        (out2.logits[0, 0] - full_a[-1]).abs().max().item(),
        (out2.logits[1, 0] - full_b[-1]).abs().max().item(),
        prefix_diff.item(),
    )


def test_18104_right_padded_prefix_plus_one_token(model):
    row0, row1, prefix = _18104(model)
    assert row0 <= TOLERANCE and row1 <= TOLERANCE and prefix <= TOLERANCE
    with stock():
        row0_stock, row1_stock, _ = _18104(model)
    assert row0_stock > WRONG, "stock transformers should get the padded row wrong (the bug this fixes)"
    assert row1_stock <= TOLERANCE


def _left_padded(model, pads):
    (row,) = random_rows([4], seed=5)
    ids = torch.tensor([[PAD] * pads + row])
    mask = torch.tensor([[0] * pads + [1] * len(row)])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits[0, pads:]
    return (logits - run_alone(model, row)).abs().max().item()


@pytest.mark.parametrize(
    "pads", [2, 32]
)  # trl#469 and transformers' test_left_padding_compatibility (32 pads)
def test_left_padding_without_position_ids(model, adapter, pads):
    assert _left_padded(model, pads) <= TOLERANCE
    if left_padding_wrong_on_stock(adapter):  # absolute positions: every real token shifts on stock
        with stock():
            assert _left_padded(model, pads) > WRONG


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_probe_scenarios(model, adapter, scenario):
    rows = scenario_rows(scenario)
    fixed = max_diff(model, rows, run_padded(model, rows, scenario.chunks, scenario.left))
    assert fixed <= TOLERANCE
    with stock():
        broken = max_diff(model, rows, run_padded(model, rows, scenario.chunks, scenario.left))
    shift_only = not left_padding_wrong_on_stock(adapter) and not has_holes(scenario)  # RoPE: no change
    if not shift_only:
        assert broken > WRONG
    elif not (adapter.eager_mask and in_range(adapter.eager_mask[0], TF)):
        assert broken <= TOLERANCE  # (where transformers' SDPA mask code is wrong, stock is wrong anyway)


def test_variable_suffixes_both_rows_wrong_on_stock(model):
    """Prefixes [3, 4] right-padded, suffixes [2, 1] left-padded (a left-padding tokenizer, as in the
    #18104 repro): with stock positions both rows go wrong."""
    rows = random_rows([5, 5], seed=7)
    chunks, left = ((3, 4), (2, 1)), ((False, False), (True, True))
    assert max_diff(model, rows, run_padded(model, rows, chunks, left)) <= TOLERANCE
    with stock():
        got = run_padded(model, rows, chunks, left)
    for row, logits in zip(rows, got):
        assert (logits - run_alone(model, row)).abs().max().item() > WRONG
