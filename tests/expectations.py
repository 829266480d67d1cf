"""What the tests expect of the declarations, kept out of the runtime package: which models the full
suite runs on, and what stock transformers gets wrong for each family."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hfpatch.verification.scenarios import Scenario

# the full suite and the compat matrix's columns: two rotary models and one absolute one
FLAGSHIPS = ("gemma", "llama", "gpt2")
ABSOLUTE = "gpt2"  # the most position-sensitive flagship: left padding in one call is wrong on stock too
# the first release where each flagship's packed rows (positions that restart) are kept to their sequences:
# its mask code takes a 4-D mask from there (tests/test_packed.py; the probe's packed cells: compat/REPORT.md)
PACKED_FROM = {"gemma": "4.38", "llama": "4.38", "gpt2": "4.52"}

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


# What a release-probe test found, recorded as a JUnit property (``kind``) that compat/evidence.py reads;
# no message is parsed. The failure kinds, in the order a cell reports them.
EXACT = "exact"
WRONG_WITH_POSITIONS = "wrong with the positions"  # hfpatch patched it and it is still wrong
STOCK_FAILS = "a scenario fails on stock too"  # transformers raises there, with or without hfpatch
STOCK_RIGHT = "right on stock there"  # nothing to patch
CLASS_DIFFERS = "class differs"  # the release's class is not the one hfpatch patches (or the patch raises)
NOT_BUILDABLE = "tiny model does not run"  # failed before anything was measured
# a model outside transformers' classes (tests/test_custom_models.py) that hfpatch left stock where it
# should patch it: not recognised, or its check on a tiny copy refused it (status() says why)
NOT_PATCHED = "not patched"
FAILURE_KINDS = (WRONG_WITH_POSITIONS, STOCK_FAILS, STOCK_RIGHT, CLASS_DIFFERS, NOT_BUILDABLE, NOT_PATCHED)
# a packed-rows probe (tests/test_architectures.py): status() says the release cannot keep the model's packed
# rows to their sequences, and its results are stock's, bit for bit (a pass: declared, not claimed)
NOT_KEPT = "packed rows not kept"
ABSENT = "absent"  # skipped: the release does not ship the model type (for a custom copy: nothing to copy)
OUTSIDE = "outside"  # skipped: outside the declared range (the probe patches it with --outside-ranges)
SKIPPED = "skipped"  # skipped for another reason (its message says)

# Models outside transformers' classes (tests/test_custom_models.py), probe type CUSTOM + their kind
# (custom-llama, custom-from-scratch, ...): what they record besides the kinds above
CUSTOM = "custom-"
LEFT_ALONE = "left alone"  # passed: a model hfpatch must not patch is not patched, its results stock's
PASS_KINDS = (EXACT, LEFT_ALONE, NOT_KEPT)
NO_CACHE_CLASS = "no DynamicCache"  # skipped: the from-scratch model uses transformers.DynamicCache (4.36+)
NOT_REMOTE_CODE = (
    "not loadable as remote code"  # skipped: transformers refuses the copy's file, hfpatch or not
)
CUSTOM_SKIP_KINDS = (ABSENT, NO_CACHE_CLASS, NOT_REMOTE_CODE, SKIPPED)


# where the probe finds a custom model not patched, each measured (compat/REPORT.md): hfpatch's check on
# a tiny copy refuses it there, so its results are stock's (wrong, as stock's are)
CUSTOM_NOT_PATCHED = {
    # the Llama adapter's SDPA_436 switch (transformers' _unmask_unattended): the custom adapter has
    # none; the tiny copy in eager attention is exact with hfpatch
    ("custom-llama", "4.36.2"): "SDPA mask of a padded cached prefix continued by several tokens",
    ("custom-llama", "4.37.2"): "SDPA mask of a padded cached prefix continued by several tokens",
    # MASK_437 (Mistral, Mixtral; Qwen2 is declared from 4.39): wrong with the right positions, eager too
    ("custom-qwen2", "4.37.2"): "the release's own mask: wrong with the right positions",
    ("custom-qwen2", "4.38.2"): "the release's own mask: wrong with the right positions",
}
