"""The pure tensor functions of hfpatch.positions, on their own."""

from __future__ import annotations

import doctest

import torch

from hfpatch import positions
from hfpatch.positions import cache_positions, new_token_positions, positions_from_mask, static_fill_level


def test_docstring_examples():
    assert doctest.testmod(positions, optionflags=doctest.NORMALIZE_WHITESPACE).failed == 0


def test_positions_skip_pads_and_holes():
    mask = torch.tensor([[1, 1, 0, 0, 1, 1], [0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    # a pad takes the position of the last real token before it (0 before the first)
    assert positions_from_mask(mask).tolist() == [[0, 1, 1, 1, 2, 3], [0, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5]]


def test_float_mask_and_all_pad_row():
    mask = torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 1.0]])
    assert positions_from_mask(mask).tolist() == [[0, 0, 0], [0, 0, 1]]


def _reference_positions(row: list) -> list:
    """Written out by hand: the running count of real tokens minus one; a pad repeats the last one."""
    out, seen = [], 0
    for value in row:
        seen += value != 0
        out.append(max(seen - 1, 0))
    return out


def test_every_form_agrees_with_a_loop_over_random_masks():
    """positions_from_mask against a plain loop; new_token_positions (a decode step, several tokens,
    by int start and by slot tensor, on masks with holes and with columns after the new tokens)
    against positions_from_mask at the same columns."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        batch, length = torch.randint(1, 5, (2,), generator=generator).tolist()
        length += 3
        mask = (torch.rand(batch, length, generator=generator) < 0.7).long()
        full = positions_from_mask(mask)
        assert full.tolist() == [_reference_positions(row) for row in mask.tolist()]
        for num_new in (0, 1, 2, 3):
            for start in range(length - num_new + 1):
                expected = full[:, start : start + num_new].tolist()
                assert new_token_positions(mask, num_new, start).tolist() == expected
                slots = torch.arange(start, start + num_new)
                assert new_token_positions(mask, num_new, slots).tolist() == expected
            upto = length - 1  # the usual mask, past + new: the new tokens are its last columns
            expected = full[:, upto - num_new : upto].tolist()
            assert new_token_positions(mask[:, :upto], num_new).tolist() == expected


def test_new_token_positions_by_slot():
    mask = torch.tensor([[1, 1, 0, 1, 1, 0, 0, 0]])  # a static cache's full-length mask, 5 filled
    assert new_token_positions(mask, 2, 3).tolist() == [[2, 3]]
    assert new_token_positions(mask, 2, torch.tensor([3, 4])).tolist() == [[2, 3]]
    assert new_token_positions(mask[:, :5], 2).tolist() == [[2, 3]]
    assert new_token_positions(mask[:, :5], 0).shape == (1, 0)


def test_new_token_positions_are_contiguous_copies():
    mask = torch.ones(1, 6, dtype=torch.long)
    out = new_token_positions(mask, 2)
    assert out.is_contiguous() and out.stride() == (2, 1)
    out += 100
    assert positions_from_mask(mask).max() == 5


def test_cache_positions():
    assert cache_positions(3, 4).tolist() == [4, 5, 6]
    assert cache_positions(2, torch.tensor([7])).tolist() == [7, 8]
    assert cache_positions(0, 4).tolist() == []


def test_static_fill_level_sees_zero_keys_and_every_row():
    keys = torch.zeros(2, 2, 8, 4)
    assert static_fill_level(keys).item() == 0
    keys[1, 1, :5] = 1.0  # only row 1, head 1 wrote anything; slot 0 of row 0 is zero
    keys[1, 1, 2] = 0.0  # a zero key inside the filled part
    assert static_fill_level(keys).item() == 5
    assert static_fill_level(torch.zeros(1, 1, 0, 4)).item() == 0
