"""The release probe's record: each probe test says which model type and attention it probes and what
it found (:data:`compat.vocabulary.FAILURE_KINDS`, or exact, with the largest stock and hfpatch
differences), as JUnit properties. compat/evidence.py reads only these (no test names, no messages)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NoReturn, Optional

import pytest

import hfpatch
from compat.vocabulary import (
    CLASS_DIFFERS,
    CUSTOM,
    EXACT,
    NOT_BUILDABLE,
    NOT_PATCHED,
    SKIPPED,
    STOCK_FAILS,
    STOCK_RIGHT,
    WRONG_WITH_POSITIONS,
)

from harness import TOLERANCE, WRONG


class Probe:
    """What one probe test found; recorded on its test item (``user_properties``) for the JUnit XML."""

    def __init__(self, node: Any) -> None:
        self.node = node
        self.kind: Optional[str] = None

    def of(self, model_type: str, attention: str = "eager") -> None:
        self.node.user_properties += [("probe_type", model_type), ("attention", attention)]

    def of_custom(self, kind: str, how: str) -> None:
        """A model outside transformers' classes (tests/test_custom_models.py): probe type ``custom-KIND``,
        the attention the release picks by default (``default``), and how it was made (``how``:
        registered, remote code, defined in the program)."""
        self.of(custom_type(kind), "default")
        self.node.user_properties.append(("how", how))

    def found(self, kind: str, stock: float = math.nan, hfpatch: float = math.nan) -> None:
        if self.kind is not None:
            return  # the first verdict stands (a later one is a consequence)
        self.kind = kind
        self.node.user_properties.append(("kind", kind))
        for name, value in (("stock", stock), ("hfpatch", hfpatch)):
            if not math.isnan(value):
                self.node.user_properties.append((name, f"{value:.2g}"))

    def judge(
        self, patched: float, on_stock: float, stock_wrong_expected: bool, wrong: Optional[bool] = None
    ) -> None:
        """The verdict of two measured numbers (the test asserts them after); ``wrong``: hfpatch's result
        is past its tolerance (default: ``patched`` past the fixed one)."""
        if patched > TOLERANCE if wrong is None else wrong:
            kind = WRONG_WITH_POSITIONS
        elif stock_wrong_expected and on_stock <= WRONG:
            kind = STOCK_RIGHT
        else:
            kind = EXACT
        self.found(kind, on_stock, patched)

    def close(self, report: Any) -> None:
        """At teardown: a test that ended without a verdict failed before measuring, or skipped."""
        if self.kind is None and report is not None:
            self.found(NOT_BUILDABLE if report.failed else SKIPPED if report.skipped else EXACT)


def custom_type(kind: str) -> str:
    """The probe type of a custom model's kind: ``custom-llama``, ``custom-from-scratch``."""
    return CUSTOM + kind.replace(" ", "-")


def skip(probe: Optional[Probe], kind: str, reason: str) -> NoReturn:
    """``pytest.skip(reason)``, recording ``kind`` (why, in the probe's words) where the test probes."""
    if probe is not None:
        probe.found(kind)
    pytest.skip(reason)


def exact_where_run(result: Any) -> bool:
    """``hfpatch.verify``'s rows all ran and are exact with hfpatch: the probe's pass. Its ``not_checked``
    aside (a model that returns no KV cache has no cached scenario; verify's verdict and exit status say
    so), which the probe does not count as wrong."""
    return bool(result.patches and result.rows) and all(row.patched <= row.tolerance for row in result.rows)


def judge_custom(
    probe: Probe, sides: list[tuple[float, float]], patched_here: bool, result: Any = None
) -> None:
    """The verdict of a custom model's test: ``sides``, (hfpatch, stock) max|diff| against each row alone
    per scenario; ``patched_here``: hfpatch recognised classes of the model and applied them all;
    ``result``: ``hfpatch.verify(model)`` (None: the test's own measurements only, a verdict only where
    they find something wrong). Not patched where it should be, wrong with the positions, right on stock
    (nothing checked), then verify's own verdict; else exact."""
    patched = max(p for p, _ in sides)
    on_stock = max(s for _, s in sides)
    if not patched_here or (result is not None and not result.patches):
        probe.found(NOT_PATCHED, on_stock, patched)
    elif patched > TOLERANCE or on_stock <= WRONG:
        probe.judge(patched, on_stock, stock_wrong_expected=True)
    elif result is None:
        return
    elif not exact_where_run(result):  # a row of verify's wrong, or raising: its verdict, with its numbers
        if result.rows:
            judge_verification(probe, result, stock_wrong_expected=True)
        probe.found(NOT_BUILDABLE)  # (verify ran no scenario)
    else:
        probe.found(EXACT, on_stock, patched)


def both_sides(probe: Probe, run: Callable[[], float], stock_raises: tuple = ()) -> tuple[float, float]:
    """``run()`` with hfpatch, then on stock (``unpatched()``). A side that raises is a verdict: the patch
    raising where stock runs is a class hfpatch does not know (``class differs``), stock raising a
    scenario that fails on stock too; ``stock_raises``: exceptions of stock that count as wrong (inf)."""
    try:
        patched = run()
    except Exception:
        with hfpatch.unpatched():
            try:
                run()
            except Exception:
                probe.found(STOCK_FAILS)
                raise
        probe.found(CLASS_DIFFERS)
        raise
    with hfpatch.unpatched():
        try:
            on_stock = run()
        except stock_raises:
            on_stock = math.inf
        except Exception:
            probe.found(STOCK_FAILS)
            raise
    return patched, on_stock


def judge_verification(probe: Probe, result: Any, stock_wrong_expected: bool) -> None:
    """The verdict of a :class:`hfpatch.verification.Verification` (its rows' numbers: nan where a side
    raised)."""
    stocks = [row.stock for row in result.rows]
    patched = [row.patched for row in result.rows]
    worst_stock = max((v for v in stocks if not math.isnan(v)), default=math.nan)
    worst_patched = max((v for v in patched if not math.isnan(v)), default=math.nan)
    if not result.patches:
        probe.found(CLASS_DIFFERS, worst_stock, worst_patched)
    elif any(math.isnan(s) and math.isnan(p) for s, p in zip(stocks, patched)):  # raised on both sides
        probe.found(STOCK_FAILS, worst_stock, worst_patched)
    elif any(math.isnan(v) for v in patched):
        probe.found(CLASS_DIFFERS, worst_stock, worst_patched)
    else:  # each scenario by its own tolerance (verify's: fp32 noise where its controls measure more)
        wrong = any(row.patched > row.tolerance for row in result.rows)
        probe.judge(worst_patched, worst_stock, stock_wrong_expected, wrong)
