"""What the tests expect of the declarations, kept out of the runtime package: what stock transformers
gets wrong for each family, and where packed rows are kept. What the tests record for the evidence
(the kinds of a probe's result, the full suite's models) is compat/vocabulary.py."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hfpatch.verification.scenarios import Scenario

ABSOLUTE = "gpt2"  # the most position-sensitive flagship: left padding in one call is wrong on stock too
# the first release where each flagship's packed rows (positions that restart) are kept to their sequences:
# its mask code takes a 4-D mask from there (tests/test_packed.py; the probe's packed cells: compat/REPORT.md)
PACKED_FROM = {"gemma": "4.39", "llama": "4.39", "gpt2": "4.52"}  # (4.38.2 takes no 4-D mask)
# where the mask code is masking_utils' (4.53 unless named): a compiled packed row's layout reaches SDPA as
# data, and flex attention takes a BlockMask
MASKING_UTILS_FROM = {"gpt2": "4.54.1"}
# where a compiled packed row's SDPA runs by sequence (its layout as data, hfpatch.compiled); GPT-2's
# module reads the mask itself (not as data): its compiled packed rows keep dense masks
COMPILED_BY_SEQUENCE_FROM = {"llama": "4.53"}

# by Family.name: whether left padding in one call is wrong on stock (absolute positions, or a rotary
# decoder whose queries meet un-rotated encoder keys in one softmax); a uniform rotary shift cancels, and
# a table past the pad id reads pads as the pad row
LEFT_PADDING_WRONG_ON_STOCK = {
    "absolute": True,
    "rotary": False,
    "absolute decoder": True,
    "rotary decoder": False,
    "rotary decoder, merged attention": True,
    "rotary decoder, audio codes": False,
    "position table": True,
    "computed sinusoid": True,
    "table past the pad id": False,
    "relative bias": False,
}


def left_padding_wrong_on_stock(adapter: Any) -> bool:
    return LEFT_PADDING_WRONG_ON_STOCK[adapter.family.name]


def has_holes(scenario: Scenario) -> bool:
    """Whether some row's mask, over all its calls, has a pad between two real tokens (else pads only
    come before its tokens: a uniform shift, which rotary positions are blind to)."""
    for r in range(len(scenario.lengths)):
        columns = []
        for counts, lefts in zip(scenario.chunks, scenario.left):
            pads = [0] * (max(counts) - counts[r])
            columns += pads + [1] * counts[r] if lefts[r] else [1] * counts[r] + pads
        text = "".join(map(str, columns)).strip("0")
        if "0" in text:
            return True
    return False
