"""The evidence's vocabulary, shared by the tests that record it (tests/probes.py, the full suite's
markers) and the scripts that read it (compat/evidence.py, compat/report.py): the models the full
suite runs on, the kinds of a probe test's result (recorded as a JUnit property, never parsed from a
message), and the rows of compat/evidence/RELEASE.json, with named fields.

Tests import it as ``compat.vocabulary`` (pytest puts the repository root on ``sys.path``); the
scripts in compat/ put the root there themselves.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

# the full suite and the compat matrix's columns: two rotary models and one absolute one
FLAGSHIPS = ("gemma", "llama", "gpt2")
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
    # Qwen2's 4-D mask decides its window by cache column there (the Qwen2 adapter is known-bad there)
    ("custom-qwen2", "4.40.2"): "the release's own mask: its window by cache column",
    ("custom-qwen2", "4.41.2"): "the release's own mask: its window by cache column",
}


class ProbeRow(NamedTuple):
    """One probe test's result in ``probe`` (a list in the file; trailing ``None`` numbers left out)."""

    probe_type: str  # the model type (or custom-KIND)
    attention: str  # eager, sdpa
    kind: str  # EXACT, one of FAILURE_KINDS, LEFT_ALONE, NOT_KEPT or a skip's kind
    stock: Optional[float] = None  # the largest |difference| from the row run alone, on stock
    hfpatch: Optional[float] = None  # the same with hfpatch


class SuiteRow(NamedTuple):
    """One full-suite test's result in ``suite`` (a list in the file)."""

    outcome: Union[str, int]  # "pass", "fail", or a skip: the index of its message in ``reasons``
    arch: str  # its flagship ("" for a test of none)
    invariant: str  # its marker: the report's column ("" for none)


def as_list(row: tuple) -> list:
    """A row as the file holds it: a list, without trailing ``None`` numbers."""
    values = list(row)
    while values and values[-1] is None:
        values.pop()
    return values
