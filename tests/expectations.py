"""What the tests expect of the declarations, kept out of the runtime package: which models the full
suite runs on, and what stock transformers gets wrong for each family."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hfpatch.verification.scenarios import Scenario

# the full suite and the compat matrix's columns: two rotary models and one absolute one
FLAGSHIPS = ("gemma", "llama", "gpt2")
ABSOLUTE = "gpt2"  # the most position-sensitive flagship: left padding in one call is wrong on stock too

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
