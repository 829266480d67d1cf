"""What :func:`hfpatch.verify` returns: a :class:`Verification` (one :class:`Row` per scenario), and
the error it raises when it cannot run (:class:`CannotVerify`)."""

from __future__ import annotations

import textwrap
from typing import NamedTuple

from ..tolerances import FP32 as TOLERANCE  # fp32, max |difference| at any real token: exact
from ..tolerances import WRONG, relative

__all__ = ["TOLERANCE", "WRONG", "CannotVerify", "Row", "Verification"]


class CannotVerify(ValueError):
    """``verify`` cannot run on this input: no such checkpoint directory, an unknown model type, or a
    model that is neither a causal LM, an image-text-to-text model nor an encoder-decoder model (the
    message says which, in one line)."""


class Row(NamedTuple):
    scenario: str
    stock: float  # max |diff| on stock transformers (nan: it raised)
    patched: float  # with hfpatch; for a model hfpatch does not patch, with positions from the mask by hand
    error: str = ""  # what raised, if something did
    # the most the judged column may differ: TOLERANCE, or four times the scenario's own fp32 noise (its
    # controls, measured where the judged column is past TOLERANCE: scenarios.control_noise)
    tolerance: float = TOLERANCE


class Verification(NamedTuple):
    """What :func:`verify` found: one :class:`Row` per scenario, whether hfpatch patches the model,
    its state, and notes (declared limits, why a scenario is not probed). ``print()`` it for a table."""

    arch: str
    state: str
    rows: tuple[Row, ...]
    notes: tuple[str, ...]
    patches: bool = True  # an adapter of hfpatch patches this model on the installed release
    by_hand: bool = True  # not patched: the second column passed positions by hand (False: it takes none)
    not_checked: tuple[str, ...] = ()  # kinds of call no scenario could check (its KV-cached calls ...)
    precision: str = "fp32"  # the regime checked: "fp32", "bfloat16 weights", "autocast float16" ...

    @property
    def ok(self) -> bool:
        """What the model gives with hfpatch is exact in every scenario (max |diff| <= 1e-5 in fp32, or
        the scenario's own fp32 noise where that is larger: ``Row.tolerance``): the patched column where
        hfpatch patches the model, stock's where it does not; and every scenario ran (none raised on both
        sides, none of ``not_checked``)."""
        column = [(row.patched if self.patches else row.stock, row.tolerance) for row in self.rows]
        return bool(column) and all(value <= bound for value, bound in column) and not self.not_checked

    @property
    def wrong(self) -> bool:
        """A scenario found the model wrong with hfpatch: beyond the tolerance, or hfpatch raising where
        stock runs (where both raise, nothing was found)."""
        if self.patches:
            return any(
                row.patched > row.tolerance or _raised_alone(row.patched, row.stock) for row in self.rows
            )
        return any(row.stock > row.tolerance for row in self.rows)

    @property
    def stock_wrong(self) -> bool:  # (raising where hfpatch runs: wrong)
        return any(not row.stock <= max(WRONG, row.tolerance) for row in self.rows)

    @property
    def verdict(self) -> str:
        if not self.rows:
            return "not checked"
        by_hand_ok = all(row.patched <= row.tolerance for row in self.rows)
        judged = [(row.patched if self.patches else row.stock, row.scenario) for row in self.rows]
        unchecked = [scenario for value, scenario in judged if value != value] + list(self.not_checked)
        partly = f"; not checked: {', '.join(unchecked)}" if unchecked else ""
        if self.patches:
            if self.ok:
                return "fixed by hfpatch" if self.stock_wrong else "right on stock and with hfpatch"
            if not self.wrong:
                return f"exact with hfpatch where checked{partly}"
            return "WRONG with hfpatch"
        if self.ok:
            return "right on stock (hfpatch does not patch it)"
        if not self.wrong:
            return f"right on stock where checked (hfpatch does not patch it){partly}"
        if not self.by_hand:
            return "wrong on stock, and hfpatch does not patch it (it takes no positions to pass by hand)"
        if by_hand_ok:
            return "wrong on stock; positions from the mask would fix it, but hfpatch does not patch it"
        return "wrong on stock, and positions from the mask do not fix it (hfpatch does not patch it)"

    def __str__(self) -> str:
        lines = [f"{self.arch}: {self.verdict} (hfpatch state: {self.state})"]
        second = "hfpatch max|diff|" if self.patches else "positions by hand"
        width = max([44, *(len(row.scenario) for row in self.rows)])
        header = f"  {'scenario':{width}}  {'stock max|diff|':>16}  {second:>18}"
        lines += [header, "  " + "-" * (len(header) - 2)]
        failures: dict[str, list[str]] = {}  # what raised -> the scenarios where it did
        for row in self.rows:
            lines.append(f"  {row.scenario:{width}}  {_cell(row.stock):>16}  {_cell(row.patched):>18}")
            if row.error:
                failures.setdefault(row.error, []).append(row.scenario)
        lines += [f"  fails: {', '.join(scenarios)}: {error}" for error, scenarios in failures.items()]
        lines += [f"  note: {note}" for note in self.notes]
        if self.precision != "fp32":
            share, regime = _share(self.precision), self.precision
            lines.append(f"  exact = max|diff| <= {share} x the rows' largest |logit| ({regime}; each row "
                         "alone, same regime)")  # fmt: skip
            return "\n".join(lines)
        lines.append(f"  exact = max|diff| <= {TOLERANCE:g} (fp32, vs each row run alone, unpadded)")
        noisy: dict[str, list[str]] = {}  # a raised tolerance -> its scenarios
        for row in self.rows:
            if row.tolerance > TOLERANCE:
                noisy.setdefault(f"{row.tolerance:.1e}", []).append(row.scenario)
        if noisy:
            each = "; ".join(
                f"{bound}: " + ("every scenario" if len(names) == len(self.rows) else ", ".join(names))
                for bound, names in noisy.items()
            )
            text = (
                "or four times the scenario's own fp32 noise (controls that change no position: its rows "
                f"right-padded in one call, each row alone through its cached calls): {each}"
            )
            lines += textwrap.wrap(text, 100, initial_indent="    ", subsequent_indent="    ")
        return "\n".join(lines)


def _share(precision: str) -> str:
    """The share of the largest |output| a half-precision regime allows, as text ("3e-02")."""
    return f"{relative(precision.split()[-1]) or 0:.0e}"


def _raised_alone(patched: float, stock: float) -> bool:
    """hfpatch raised (nan) where stock ran."""
    return patched != patched and stock == stock


def _cell(value: float) -> str:
    return "fails" if value != value else f"{value:.2e}"  # nan: the call raised
