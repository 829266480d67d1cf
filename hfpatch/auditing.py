"""``hfpatch audit``: what stock transformers got wrong in a run, with its results unchanged.

    with hfpatch.audit() as report:      # or: hfpatch audit --json audit.json -- python train.py
        ...                              # stock results, bit for bit
    print(report)                        # per model type: calls, how many stock got wrong, where

While an audit runs, the patched forward of every class hfpatch patches is installed but runs stock
(unless ``apply()`` or a ``patched()`` block asks for the patch: such calls are counted as patched).
Each outermost call is judged before it runs, from its arguments alone, by the rules hfpatch's families
encode (:func:`hfpatch.positions.stock_error`): stock numbers the tokens by column; a token is wrong
where that changes what it computes (any shift of absolute positions; a pad after the row's first real
token for rotary positions and relative biases; sliding windows counted in columns; rope scaled by the
batch's length instead of the row's). Calls it cannot judge (a 4-D mask, a static cache, attention
chunks) are counted as such, and model types hfpatch does not patch are listed, not counted right.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

from . import engine
from .declarations import THROUGH_LANGUAGE_MODEL

__all__ = ["AuditReport", "audit", "audit_this_process", "merge"]

WRITE_AFTER = 0.02  # seconds an audited process waits after a call before writing its counts (a burst: once)
COUNTS = ("calls", "affected", "rows", "tokens", "worst_shift", "patched", "positions_given", "packed")


class AuditReport:
    """Per model type (``config.model_type``): ``calls`` seen, ``affected`` (calls stock got wrong),
    ``rows`` and ``tokens`` affected, ``worst_shift`` (the most pads before a wrong token: how far its
    stock position is off), ``patched`` (calls hfpatch's patch ran), ``positions_given`` (calls with the
    caller's positions: theirs, not judged), ``packed`` (calls whose rows pack several sequences, the
    caller's positions restarting: judged, a token wrong where stock lets it see the sequences before
    it), ``not_judged`` (reason -> calls) and ``sites`` (the first
    frame outside transformers and torch -> ``calls``, ``affected``). ``unknown``: model types of models in
    memory that hfpatch does not patch, with why (their calls are not counted at all)."""

    def __init__(self) -> None:
        self.types: dict[str, dict[str, Any]] = {}
        self.unknown: dict[str, str] = {}
        self._lock = threading.Lock()
        self.changed = threading.Event()  # set by each call counted (audit_this_process writes then)

    def _entry(self, arch: str) -> dict[str, Any]:
        found = self.types.get(arch)
        if found is None:
            found = self.types[arch] = {**dict.fromkeys(COUNTS, 0), "not_judged": {}, "sites": {}}
        return found

    def count(
        self,
        arch: str,
        site: str,
        patched: bool,
        given: bool,
        unjudged: Optional[str],
        stats: Optional[list[int]],
    ) -> None:
        """One call of ``arch`` from ``site`` (the audit's judge counts each): ``patched`` (hfpatch's patch
        ran), ``given`` (the caller's positions: theirs, not judged), ``unjudged`` (why else it was not
        judged), ``stats`` (judged: [rows, tokens, worst shift] stock got wrong, and a fourth item where
        the call packs rows)."""
        with self._lock:
            entry = self._entry(arch)
            entry["calls"] += 1
            entry["patched"] += patched
            at = entry["sites"].setdefault(site, [0, 0])
            at[0] += 1
            if given:
                entry["positions_given"] += 1
            elif unjudged is not None:
                entry["not_judged"][unjudged] = entry["not_judged"].get(unjudged, 0) + 1
            if stats is not None and stats[3:]:
                entry["packed"] += 1
            if stats is not None and stats[0]:
                entry["affected"] += 1
                at[1] += 1
                entry["rows"] += stats[0]
                entry["tokens"] += stats[1]
                entry["worst_shift"] = max(entry["worst_shift"], stats[2])
        self.changed.set()

    def as_dict(self) -> dict[str, Any]:
        """Model type -> its counts (JSON-ready); a type hfpatch does not patch maps to ``calls: None``
        and why."""
        with self._lock:
            data = {arch: json.loads(json.dumps(entry)) for arch, entry in sorted(self.types.items())}
        for entry in data.values():
            entry["sites"] = {
                site: {"calls": n, "affected": wrong} for site, (n, wrong) in entry["sites"].items()
            }
        for arch, why in sorted(self.unknown.items()):
            data.setdefault(arch, {"calls": None, "affected": None, "not_judged": {why: None}})
        return data

    def __str__(self) -> str:
        return table(self.as_dict())


def table(data: dict[str, Any]) -> str:
    """The short table ``hfpatch audit`` prints: one line per model type, then one per call site of
    wrong calls, then what it could not judge."""
    rows = [
        ("model type", "calls", "not judged", "wrong", "rows", "tokens", "worst shift", "packed", "patched")
    ]
    sites: dict[str, list[str]] = {}
    unjudged = []
    for arch, entry in data.items():
        if entry.get("calls") is None:
            unjudged.append(f"{arch} ({next(iter(entry['not_judged']))})")
            continue
        reasons = dict(entry["not_judged"])
        if entry.get("positions_given"):
            reasons = {"the caller's positions": entry["positions_given"], **reasons}
        counts = (entry[name] for name in ("affected", "rows", "tokens", "worst_shift", "packed", "patched"))
        rows.append((arch, str(entry["calls"]), str(sum(reasons.values())), *map(str, counts)))
        for site, at in entry["sites"].items():
            if at["affected"]:
                sites.setdefault(site, []).append(f"{arch} {at['affected']} of {at['calls']} calls")
        unjudged += [f"{arch}: {n} calls ({why})" for why, n in reasons.items()]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["hfpatch audit: what stock transformers got wrong by positions and packing (results unchanged)"]
    for row in rows:
        lines.append(
            "  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths)))
        )
    if len(rows) == 1:
        lines.append("no call of a model hfpatch patches was seen")
    lines += [f"wrong calls at {site}: {', '.join(found)}" for site, found in sites.items()]
    if unjudged:
        lines.append("not judged: " + "; ".join(unjudged))
    return "\n".join(lines)


def merge(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """The counts of several processes' reports (:meth:`AuditReport.as_dict`), added up."""
    merged: dict[str, Any] = {}
    for data in reports:
        for arch, entry in data.items():
            if entry.get("calls") is None:
                merged.setdefault(arch, entry)
                continue
            into = merged.get(arch)
            if into is None or into.get("calls") is None:
                into = merged[arch] = {**dict.fromkeys(COUNTS, 0), "not_judged": {}, "sites": {}}
            for name in COUNTS:
                into[name] = (
                    max(into[name], entry[name]) if name == "worst_shift" else into[name] + entry[name]
                )
            for why, n in entry["not_judged"].items():
                into["not_judged"][why] = into["not_judged"].get(why, 0) + n
            for site, at in entry["sites"].items():
                before = into["sites"].setdefault(site, {"calls": 0, "affected": 0})
                before["calls"] += at["calls"]
                before["affected"] += at["affected"]
    return dict(sorted(merged.items()))


@contextlib.contextmanager
def audit() -> Iterator[AuditReport]:
    """Count, per model type, the calls inside the block that stock transformers gets wrong by
    positions; their results are stock's, bit for bit. The report is complete when the block ends."""
    report = AuditReport()
    stop = start(report)
    try:
        yield report
    finally:
        stop()


def start(report: AuditReport) -> Any:
    """Start auditing every thread's calls into ``report``; returns the function that stops it."""
    from .judge import Watcher  # imports torch: only when an audit starts

    unsubscribe = engine.subscribe(Watcher(report))

    def stop() -> None:
        unsubscribe()
        report.unknown.update(_unknown_types(report))

    return stop


def audit_this_process(folder: str) -> None:
    """What ``HFPATCH_AUDIT=FOLDER`` does (set by ``hfpatch audit``, read by :mod:`hfpatch.launcher`):
    audit this process and write its counts to ``FOLDER/PID.json`` at exit: a normal one (atexit), or
    ``os._exit()`` (which skips atexit: torchrun scripts and multiprocessing's forked children end so),
    which in an audited process writes first."""
    report = AuditReport()
    stop = start(report)
    written: list[bool] = []

    def snapshot() -> None:
        path = Path(folder) / f"{os.getpid()}.json"
        with contextlib.suppress(OSError):  # whole or not at all: the launcher may read it any time
            path.with_suffix(".part").write_text(json.dumps(report.as_dict()))
            os.replace(path.with_suffix(".part"), path)

    def write() -> None:
        if written:
            return
        written.append(True)
        stop()
        snapshot()

    def keep_writing() -> None:  # a process killed without exiting (Ray workers at shutdown) loses the
        # calls of its last WRITE_AFTER seconds at most
        while not written:
            report.changed.wait()
            time.sleep(WRITE_AFTER)
            report.changed.clear()
            if not written:
                snapshot()

    atexit.register(write)
    exit_now = os._exit

    def _exit(status: int) -> None:
        with contextlib.suppress(Exception):
            write()
        exit_now(status)

    os._exit = _exit

    def writer() -> None:
        threading.Thread(target=keep_writing, name="hfpatch-audit", daemon=True).start()

    def forked() -> None:  # a forked child starts with the parent's counts: its file counts its own calls
        report.types.clear()
        writer()

    os.register_at_fork(after_in_child=forked)
    writer()
    engine.applied_by(f"hfpatch audit (process {os.getpid()}): stock results, calls counted")


def _unknown_types(report: AuditReport) -> dict[str, str]:
    """Model types of the models in memory whose calls the audit does not see (hfpatch does not patch
    them), with why (``status()``'s reason)."""
    base = getattr(sys.modules.get("transformers.modeling_utils"), "PreTrainedModel", None)
    if base is None:
        return {}
    types = {getattr(getattr(o, "config", None), "model_type", None)
             for o in gc.get_objects() if issubclass(type(o), base)}  # fmt: skip
    status = engine.status()
    unknown = {}
    for arch in sorted(t for t in types if isinstance(t, str) and t not in report.types):
        if engine.adapter_for(arch) is not None and engine.patchable(arch):
            continue  # watched, and not called
        entry = status.get(arch)
        if entry is not None and entry.state == THROUGH_LANGUAGE_MODEL:
            continue  # its calls run through its language model's class, which is watched
        unknown[arch] = (
            f"hfpatch does not patch it ({entry.state or entry.support})"
            if entry is not None
            else "hfpatch does not know this model type"
        )
    return unknown
