"""What ``hfpatch.status()`` returns: the state names, one model type's entry (:class:`AdapterStatus`) and
the read-only mapping of them all with the process's counts (:class:`Status`), printed as a table. The
engine fills them; this room holds no state of its own."""

from __future__ import annotations

import difflib
import textwrap
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple, Optional

from . import custom
from ._context import CALL, PACKED, Pin
from .declarations import NOT_COVERED, Adapter, Undeclared, kept, why_not
from .patches import Patch
from .support import (
    CUSTOM,
    NEW_TYPE,
    NEWEST_TESTED,
    UNTESTED_NEWER,
    UNVERIFIED,
    Support,
    in_range,
    newer_types,
    support,
)

__all__ = [
    "APPLIED",
    "CHECKING",
    "NOT_APPLIED",
    "PACKED_OFF",
    "SKIPPED",
    "WAITING",
    "AdapterState",
    "AdapterStatus",
    "Status",
    "adapter_status",
    "nearest",
    "packed_answer",
    "packed_undeclared",
    "table",
]

APPLIED = "applied"
WAITING = "waiting for import"
CHECKING = "waiting for its check"
SKIPPED = "skipped"
NOT_APPLIED = "not applied"


class AdapterState:
    """What the engine knows of one adapter (its registry holds one per adapter; :func:`table` reads them)."""

    __slots__ = (
        "adapter", "pin", "holders", "hooked", "forced", "rows", "installed", "skip_reason", "class_differs",
        "owner",
    )  # fmt: skip

    def __init__(self, adapter: Adapter, owner: Optional[type] = None) -> None:
        self.adapter = adapter
        self.pin = Pin(adapter.arch)  # pinned: apply() asked for it (until revert()); its forward reads it
        self.holders: set[object] = set()  # tokens of the patched() blocks still open, in any thread
        self.hooked = False  # a post-import hook is registered for its module (wrapt keeps hooks forever)
        self.forced = False  # apply(..., ignore_ranges=True) asked for it, whatever its range says
        self.rows: tuple[Patch, ...] = ()  # what it replaces, built once per class and kept
        self.installed = False
        self.skip_reason: Optional[str] = None
        self.class_differs = False  # its module's class is not the one it patches (its build failed)
        self.owner = owner  # a class outside transformers (hfpatch.custom), else None

    @property
    def wanted(self) -> bool:
        return self.pin.pinned or bool(self.holders)

    @property
    def checked(self) -> Optional[bool]:
        """A custom class's check on a tiny copy: passed, failed, or None (not yet, or running)."""
        return custom.CHECKS.verdict(self.owner)[0] if self.owner is not None else None

    @property
    def check_reason(self) -> str:
        return custom.CHECKS.verdict(self.owner)[1] if self.owner is not None else ""


class AdapterStatus(NamedTuple):
    """One model type: its ``state`` (``applied``, ``waiting for import``, ``waiting for its check`` (a
    class outside transformers defined after ``apply()``, until its first call), ``skipped``, ``not applied``;
    or, for model types hfpatch does not patch, ``right on stock``, ``not fixable by positions``,
    ``not covered``, ``through its language model``), why, the ``target`` and ``versions`` of the adapter
    that patches it, its ``support`` on the installed release (``tested``, ``untested newer``,
    ``known-bad``, ``unverified``, ``outside``; empty for model types without an adapter), and
    ``packed``: whether a row packing several sequences (positions that restart) is kept to them
    (``yes (eager, SDPA ...)``, ``no: why``; empty where no such row reaches it, or until its module is
    imported)."""

    arch: str
    target: str
    versions: str
    state: str
    reason: str
    support: str
    packed: str = ""


class Status(Mapping):
    """What ``hfpatch.status()`` returns: a read-only mapping from model type to its
    :class:`AdapterStatus` (``status()["qwen2"].state``, ``"mamba" in status()``), plus the installed
    ``transformers`` release and how hfpatch was applied (``applied_by``). ``print()`` it for a table."""

    __slots__ = ("transformers", "applied_by", "shadow", "unpadded", "_entries")  # not a dataclass: ~1 ms

    def __init__(
        self,
        transformers: Optional[str],
        entries: tuple[AdapterStatus, ...],
        applied_by: str = "",
        shadow: Optional[Mapping[str, Any]] = None,
        unpadded: Optional[Mapping[str, Any]] = None,
    ) -> None:
        self.transformers = transformers
        # this process's hfpatch.shadow checks: rows ``checked``, ``mismatches``, the ``worst`` |difference|,
        # and the calls it did not check, by reason (``skipped``; calls sampled out are not counted)
        counts = dict(shadow or {"checked": 0, "mismatches": 0, "worst": 0.0, "skipped": {}})
        counts["skipped"] = MappingProxyType(dict(counts.get("skipped", {})))
        self.shadow = MappingProxyType(counts)
        # apply(unpad=True): whether it is ``on``, the padded ``calls`` run on their real tokens, and those
        # left padded, by reason (``padded``)
        unpadded = dict(unpadded or {"on": False, "calls": 0, "padded": {}})
        unpadded["padded"] = MappingProxyType(dict(unpadded.get("padded", {})))
        self.unpadded = MappingProxyType(unpadded)
        # "import hfpatch.auto", the launcher, the Ray setup hook, "hfpatch.apply() in this program", or
        # "" where nothing applied hfpatch
        self.applied_by = applied_by
        self._entries = {entry.arch: entry for entry in entries}

    @property
    def adapters(self) -> tuple[AdapterStatus, ...]:
        """Every entry, in registry order."""
        return tuple(self._entries.values())

    def __getitem__(self, arch: str) -> AdapterStatus:
        try:
            return self._entries[arch]
        except (KeyError, TypeError):
            hint = nearest(arch, list(self._entries)) if isinstance(arch, str) else ""
            message = f"no model type {arch!r} known to hfpatch{hint}; print(hfpatch.status()) lists them"
            raise KeyError(message) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Status):
            return NotImplemented
        return (self.transformers, self.adapters) == (other.transformers, other.adapters)

    def __repr__(self) -> str:
        return f"Status(transformers={self.transformers!r}, adapters={self.adapters!r})"

    def __str__(self) -> str:
        """A table that fits 100 columns: a row per model type, its reason wrapped under it
        (``status()[arch]`` has the target and versions too)."""
        rows = [("arch", "state", "support", "packed")]
        rows += [(a.arch, a.state, a.support, a.packed.split(" ")[0].rstrip(":")) for a in self.adapters]
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        widths[0] = min(widths[0], 40)  # a longer model type (a class of the user's) has a line of its own
        lines = [f"transformers {self.transformers or 'not installed'}"]
        if self.applied_by:
            lines.append(f"applied by {self.applied_by}")
        for row, entry in zip(rows, (None, *self.adapters)):
            if len(row[0]) > widths[0]:
                lines.append(row[0])
                row = ("", *row[1:])
            lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)))
            if entry is not None and entry.reason:
                lines += textwrap.wrap(entry.reason, 100, initial_indent="    ", subsequent_indent="    ")
        if self.unpadded["on"] or self.unpadded["calls"]:
            padded = sum(self.unpadded["padded"].values())
            lines.append(
                f"unpadded calls: {self.unpadded['calls']}"
                + (f", {padded} left padded (status().unpadded['padded'] says why)" if padded else "")
            )
        if self.shadow["checked"] or self.shadow["skipped"]:
            skipped = sum(self.shadow["skipped"].values())
            lines.append(
                f"shadow checks: {self.shadow['checked']} rows, {self.shadow['mismatches']} mismatches"
                + (f", {skipped} calls not checked (status().shadow['skipped'] says why)" if skipped else "")
            )
        lines.append("Patch before torch.compile, or call torch._dynamo.reset() after apply()/revert().")
        return "\n".join(line.rstrip() for line in lines)


def nearest(name: str, known: list[str]) -> str:
    """`` (did you mean a or b?)`` for the known names closest to ``name`` (ignoring case), or ``""``."""
    lower = {k.lower(): k for k in known}
    close = [lower[c] for c in difflib.get_close_matches(name.lower(), list(lower), n=3)]
    return f" (did you mean {' or '.join(close)}?)" if close else ""


def adapter_status(state: AdapterState, version: Any) -> AdapterStatus:
    """One adapter's entry, from what the engine knows of it (its :class:`AdapterState`) and this
    thread's choice."""
    adapter = state.adapter
    verdict = support(adapter, version)
    if state.forced and not verdict.patchable:
        verdict = Support(verdict.level, f"patched with apply(..., ignore_ranges=True); {verdict.reason}")
    if state.check_reason:
        verdict = Support(verdict.level, f"{verdict.reason}; {state.check_reason}")
    here = (CALL.overrides or {}).get(adapter.arch)  # this thread's patched()/unpatched() choice, if any
    if state.pin.awaiting is not None and here is None:
        entry = (
            CHECKING,
            "defined after apply(): checked on a tiny copy at its first call, patched if exact",
        )
    elif state.installed and (state.pin.pinned if here is None else here):
        entry = (APPLIED, verdict.reason)
    elif state.skip_reason is not None:
        entry = (SKIPPED, state.skip_reason)
    elif here is False:
        entry = (NOT_APPLIED, "stock in this thread: inside hfpatch.unpatched()")
    elif state.wanted and not state.installed:
        entry = (WAITING, f"patched when {adapter.module} is imported; {verdict.reason}")
    elif state.installed:
        entry = (NOT_APPLIED, "patched only inside other threads' hfpatch.patched() blocks")
    else:
        entry = (NOT_APPLIED, "hfpatch.apply() has not been called (or revert() was)")
    return AdapterStatus(
        adapter.arch, adapter.target, adapter.versions, *entry, verdict.level, packed_answer(state, entry[0])
    )


PACKED_OFF = "no: left to stock (apply(packed=False), or HFPATCH_PACKED=0)"


def packed_answer(state: Any, how: str) -> str:
    """Whether a packed row of the adapter's class is kept to its sequences now: its patch's answer where
    it is applied (``yes (attentions)``, ``no: why``), else no, and why."""
    if not PACKED[0]:
        return PACKED_OFF
    if how != APPLIED:
        declared = state.adapter.packed
        why = (
            why_not(declared)
            if declared and not kept(declared)
            else "not patched until its module is imported (hfpatch status TYPE imports it)"
            if how == WAITING
            else f"not patched ({how})"
        )
        return f"no: {why}"
    return getattr(state.rows[0].replacement, "__hfpatch_packed__", "")


def packed_undeclared(entry: Undeclared, answers: Mapping[str, str]) -> str:
    """A model type hfpatch does not patch keeps its packed rows as stock does: not to their sequences
    (or as declared); a wrapper whose language model a patched class runs, as that one does."""
    if not PACKED[0]:
        return PACKED_OFF
    if entry.packed:
        return entry.packed
    own = answers.get(entry.language_model or "")
    if not own:
        return "no: hfpatch does not patch it"
    name = entry.language_model
    if kept(own):
        return f"yes: by its language model, which the {name!r} adapter patches {own[3:].strip()}"
    return f"no: its language model's ({name!r}): {why_not(own)}"


def new_types(version: Any, known: list[str]) -> tuple[AdapterStatus, ...]:
    """The entries of a newer release's model types that no tested release has: not covered."""
    why = NEW_TYPE.format(version=version, newest=NEWEST_TESTED)
    return tuple(
        AdapterStatus(arch, "", "", NOT_COVERED, why, UNTESTED_NEWER, "no: hfpatch does not patch it")
        for arch in newer_types(version, known)
    )


def table(
    registry: Mapping[str, Adapter],
    states: Mapping[str, Any],
    undeclared: Mapping[str, Undeclared],
    left_alone: Mapping[str, str],
    version: Any,
) -> tuple[AdapterStatus, ...]:
    """Every model type's entry: each adapter's (:func:`adapter_status`) and its aliases', the model
    types hfpatch does not patch, and the classes outside transformers it left alone (and why)."""
    entries = []
    for name, adapter in registry.items():
        entry = adapter_status(states[name], version)
        entries.append(entry)
        since = dict(adapter.alias_since)
        for alias in adapter.aliases:
            reason = f"runs {adapter.cls}, patched by the {name!r} adapter; {entry.reason}"
            alias_entry = entry._replace(arch=alias, reason=reason)
            if alias in since and version is not None and not in_range(f">={since[alias]}", version):
                reason += f"; {alias} is unverified before {since[alias]} (its tiny model builds there)"
                alias_entry = alias_entry._replace(reason=reason, support=UNVERIFIED)
            entries.append(alias_entry)
    answers = {entry.arch: entry.packed for entry in entries}
    entries += [
        AdapterStatus(u.arch, "", "", u.verdict, u.reason, "", packed_undeclared(u, answers))
        for u in undeclared.values()
    ]
    entries += [
        AdapterStatus(arch, "", "", NOT_COVERED, why, CUSTOM, "no: hfpatch does not patch it")
        for arch, why in left_alone.items()
    ]
    return tuple(entries)
