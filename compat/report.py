"""compat/evidence/*.json (compat/evidence.py) -> compat/REPORT.md.

    python compat/report.py           # write compat/REPORT.md
    python compat/report.py --check   # exit 1 if compat/REPORT.md is not what the evidence gives

Two kinds of results per release, as the tests recorded them (JUnit properties, no names or messages
read): the full test suite on the flagship architectures (each test's ``invariant`` and ``arch``), and
the release probe (each probe test's model type, attention and ``kind``: exact, or why not). A full-suite
cell is ``pass`` when every test of it passed (some may skip), ``FAIL`` when one failed, ``n/a`` when
all skipped (the reason is footnoted), ``known-bad`` where the adapter declares the release known-bad. A
probe cell (a model type and attention on a release) is the worst of its tests.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from packaging.version import Version  # noqa: E402

import hfpatch  # noqa: E402
from compat.vocabulary import (  # noqa: E402
    ABSENT,
    CLASS_DIFFERS,
    CUSTOM,
    CUSTOM_SKIP_KINDS,
    FAILURE_KINDS,
    FLAGSHIPS,
    NO_CACHE_CLASS,
    NOT_BUILDABLE,
    NOT_KEPT,
    NOT_PATCHED,
    NOT_REMOTE_CODE,
    PASS_KINDS,
    STOCK_FAILS,
    STOCK_RIGHT,
    WRONG_WITH_POSITIONS,
    ProbeRow,
    SuiteRow,
)
from hfpatch.support import KNOWN_BAD, TESTED, support  # noqa: E402

from matrix import (  # noqa: E402
    COMPILE_SMOKE,
    ONCE,
    ONCE_MARKERS,
    ONCE_PARAMETERS,
    PROBE_ONCE,
    RELEASES,
    SAMPLE,
    TORCH,
)

REGISTRY = dict(hfpatch.registry())
ARCHS = list(FLAGSHIPS)  # the full suite's columns
INVARIANTS = {  # the full suite's columns (a test's ``invariant`` marker), what each checks
    "I1": "padding / cache-split equivalence",
    "I2": "explicit inputs unchanged",
    "I3": "no mask (or 4-D mask) unchanged",
    "I4": "generate unchanged",
    "I5": "cache_position optional",
    "I6": "torch.compile",
    "I7": "lifecycle and errors",
}
OUTCOME_ORDER = {"skip": 0, "pass": 1, "fail": 2}
PACKED_TEST = "test_architectures::test_packed_rows_covered_architecture"  # its cells: a section of their own


def load(release: str) -> dict:
    path = HERE / "evidence" / f"{release}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def suite_cells(evidence: dict) -> dict:
    """{arch or "any": {invariant or "other": (state, reason)}}: pass, fail, or n/a (all skipped)."""
    grouped: dict = {}
    for entries in evidence.get("suite", {}).values():
        for row in (SuiteRow(*values) for values in entries.values()):
            skipped = isinstance(row.outcome, int)
            reason, state = (evidence["reasons"][row.outcome], "skip") if skipped else ("", row.outcome)
            column = grouped.setdefault(row.arch or "any", {}).setdefault(row.invariant or "other", [])
            column.append((state, reason))
    cells: dict = {}
    for arch, columns in grouped.items():
        for column, results in columns.items():
            states = [state for state, _ in results]
            if "fail" in states:
                cell = ("fail", "")
            elif "pass" in states:
                cell = ("pass", "")
            else:
                cell = ("n/a", sorted(reason for _, reason in results)[0])
            cells.setdefault(arch, {})[column] = cell
    return cells


def probe_cells(evidence: dict, packed: bool = False) -> dict:
    """{model type: {attention: {"outcome", "kind", "stock", "hfpatch"}}}: the worst of each cell's tests
    (any failure, else any pass, else a skip: absent where a test said the release lacks the type);
    ``packed``: the packed-rows test's cells alone (else every other probe test's)."""
    cells: dict = {}
    for function, entries in evidence.get("probe", {}).items():
        if (function == PACKED_TEST) != packed:
            continue
        for row in (ProbeRow(*values) for values in entries.values()):
            kind = row.kind
            outcome = "fail" if kind in FAILURE_KINDS else "pass" if kind in PASS_KINDS else "skip"
            by_attention = cells.setdefault(row.probe_type, {})
            cell = by_attention.setdefault(row.attention, {"outcome": "skip", "kinds": set()})
            if OUTCOME_ORDER[outcome] > OUTCOME_ORDER[cell["outcome"]]:
                cell["outcome"] = outcome
            cell["kinds"].add(kind)
            for name, value in (("stock", row.stock), ("hfpatch", row.hfpatch)):
                if value is not None:
                    cell[name] = max(value, cell.get(name, value))
    return cells


def probe_verdict(runs: dict) -> str:
    """One release's probe of one model type (its cells, eager and SDPA): ``pass``, ``fail``, ``absent``
    (the release does not ship it: no row, compat/evidence.py keeps none) or ``outside`` (skipped)."""
    if not runs:
        return "absent"
    outcomes = {run["outcome"] for run in runs.values()}
    if "fail" in outcomes:
        return "fail"
    if "pass" in outcomes:
        return "pass"
    return "absent" if any(ABSENT in run["kinds"] for run in runs.values()) else "outside"


# a failing cell's reason, the first its tests found of: the patch is not applied there (so every
# scenario is wrong), stock raises, nothing could be measured, stock is right, hfpatch is wrong
CELL_REASONS = (CLASS_DIFFERS, NOT_PATCHED, STOCK_FAILS, NOT_BUILDABLE, STOCK_RIGHT, WRONG_WITH_POSITIONS)
assert set(CELL_REASONS) == set(FAILURE_KINDS)


def failure_kind(runs: dict) -> str:
    """A failing cell's reason (eager and SDPA): the first of :data:`CELL_REASONS` its tests found."""
    kinds = set().union(*(run["kinds"] for run in runs.values() if run["outcome"] == "fail"))
    return next((kind for kind in CELL_REASONS if kind in kinds), NOT_BUILDABLE)


def build() -> dict:
    """{release: {"ran", "cells", "cases", "probe", "code", "failing"}} from the evidence files."""
    summary = {}
    for release in RELEASES:
        evidence = load(release)
        probe = probe_cells(evidence)
        packed = probe_cells(evidence, packed=True)
        cells = suite_cells(evidence)
        failing = any(state == "fail" for columns in cells.values() for state, _ in columns.values())
        failing |= any(
            run["outcome"] == "fail" and _patched_on(REGISTRY[model_type], release)
            for model_type, runs in probe.items()
            if model_type in REGISTRY
            for run in runs.values()
        )
        failing |= any(  # packed rows claimed kept and wrong
            run["outcome"] == "fail" and _patched_on(REGISTRY[model_type], release)
            for model_type, runs in packed.items()
            if model_type in REGISTRY
            for run in runs.values()
        )
        failing |= any(  # a model outside transformers' classes patched and wrong, or not left alone
            custom_verdict(runs) == "fail" and failure_kind(runs) != NOT_PATCHED  # (refused: like outside)
            for model_type, runs in probe.items()
            if model_type.startswith(CUSTOM)
        )
        summary[release] = {
            "ran": bool(evidence.get("suite")),
            "cells": cells,
            "cases": evidence.get("cases", {}),
            "probe": probe,
            "packed": packed,
            "code": evidence.get("code", {}),
            "run": evidence.get("run", {}),
            "failing": failing,
        }
    return summary


def probe_verdicts(summary: dict) -> dict:
    """{model type: {release: "pass" | "fail" | "outside" | "absent"}} over the probed releases."""
    verdicts: dict = {}
    for release, entry in summary.items():
        for model_type, runs in entry["probe"].items():
            verdicts.setdefault(model_type, {})[release] = probe_verdict(runs)
    return verdicts


def render(summary: dict) -> str:
    footnotes: list[str] = []

    def footnote(reason: str) -> int:
        if reason not in footnotes:
            footnotes.append(reason)
        return footnotes.index(reason) + 1

    def show(cell: tuple | None) -> str:
        if cell is None:
            return "-"
        state, reason = cell
        if state == "n/a":
            return f"n/a<sup>{footnote(reason)}</sup>"
        return {"pass": "pass", "fail": "**FAIL**"}[state]

    ran = [r for r, e in summary.items() if e["ran"]]
    failing = [r for r in ran if summary[r]["failing"]]
    counts = [c for r in ran for c in summary[r]["cases"].values()]
    stock_wrong = sum(c.get("stock_wrong", 0) for c in counts)
    patched_wrong = sum(c.get("hfpatch_wrong", 0) for c in counts)
    total_cases = sum(c.get("cases", 0) for c in counts)
    headline = (
        f"**{len(ran)} of {len(summary)} releases tested; {len(ran) - len(failing)} pass every applicable "
        f"check. Randomized padding/cache-split cases: {stock_wrong} of {total_cases} wrong on stock "
        f"transformers, {patched_wrong} with hfpatch.**"
    )
    lines = [
        "# hfpatch compatibility report",
        "",
        "Generated by `python compat/report.py` from `compat/evidence/` (one file per release, made by",
        "`compat/evidence.py` from the JUnit XML of `bash compat/run_matrix.sh` (`compat/one_commit.sh`: the",
        "release probe, every covered model type in its declared range or not, and the test suite on the",
        f"flagship architectures, one virtualenv per release with {TORCH} CPU, the `matrix` hypothesis",
        "profile, no inductor test, one torch thread; earlier runs: `bash compat/probe_matrix.sh` and the",
        "suite apart). Do not edit by hand.",
        f"Code tested: {_commits(summary)} (each release's in the *code* column).",
        "",
        *_one_commit(summary),
        "",
        headline,
        "",
        "Invariants: " + "; ".join(f"**{code}** {what}" for code, what in INVARIANTS.items()) + ".",
        "",
    ]
    header = ["release"] + [f"{arch} {code}" for arch in ARCHS for code in INVARIANTS]
    header += ["general", "code", "ran"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for release, entry in summary.items():
        if not entry["ran"]:
            lines.append(f"| {release} | " + " | ".join(["not run"] * (len(header) - 1)) + " |")
            continue
        row = [release]
        for arch in ARCHS:
            verdict = support(REGISTRY[arch], Version(release))
            if verdict.level == KNOWN_BAD:
                row += [f"known-bad<sup>{footnote(verdict.reason)}</sup>"] * len(INVARIANTS)
                continue
            row += [show(entry["cells"].get(arch, {}).get(code)) for code in INVARIANTS]
        general = [*entry["cells"].get("any", {}).values(), *entry["cells"].get("", {}).values()]
        row.append("**FAIL**" if any(state == "fail" for state, _ in general) else "pass")
        row += [_code(entry), entry["run"].get("ran", "-")]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "## Randomized cases: wrong on stock transformers vs with hfpatch", ""]
    lines += [
        "40 fixed random cases per architecture (1-3 rows, 1-3 KV-cached calls, 0-4 new tokens per row and",
        "call, left or right padding per row and call); wrong = some real token's logits off by more than",
        '1e-5 from the row run alone, unpadded, or the call crashed ("crashed": transformers raised, on',
        "stock and with hfpatch alike).",
        "",
        "| release | " + " | ".join(f"{arch} stock | {arch} hfpatch" for arch in ARCHS) + " |",
        "|---|" + "---|---|" * len(ARCHS),
    ]
    for release, entry in summary.items():
        row = [release]
        for arch in ARCHS:
            count = entry["cases"].get(arch, {})
            row += [_wrong(count, "stock"), _wrong(count, "hfpatch")] if "cases" in count else ["n/a", "n/a"]
        lines.append("| " + " | ".join(row) + " |")
    lines += _render_probe(summary)
    lines += _render_packed(summary)
    lines += _render_custom(summary)
    lines += ["", "## Notes: why a cell is n/a, known-bad or marked", ""]
    lines += [f"{i + 1}. {reason}" for i, reason in enumerate(footnotes)]
    return "\n".join(lines) + "\n"


def _render_probe(summary: dict) -> list[str]:
    probed = [r for r, e in summary.items() if e["probe"]]
    if not probed:
        return ["", "## Architectures", "", "No probe results yet: run `bash compat/probe_matrix.sh`."]
    verdicts = probe_verdicts(summary)
    newest = probed[-1]
    lines = [
        "",
        "## Architectures: the probe on every release that ships them",
        "",
        f"`hfpatch.verify` on a tiny random model of each covered causal LM, eager and SDPA attention, on "
        f"{len(probed)} releases ({probed[0]} to {newest}): left padding, a right-padded cached prefix + 1 "
        "token, variable prefixes and suffixes (dynamic cache, and a StaticCache where the model takes one); "
        "for the decoders of encoder-decoder models, `tests/test_decoders.py` (the same decoder scenarios "
        "with `decoder_attention_mask`, and a left-padded encoder), and for vision-language models, "
        "`tests/test_wrappers.py` (a padded text prefix continued from the cache, a left-padded prompt, an "
        "image where the test has one), each row against itself run alone. A cell is the worst of the "
        "probe's tests of a model type on a release, in the declared range or not (with `--outside-ranges`, "
        "the probe patches it with `apply(..., ignore_ranges=True)`). *ships*: the matrix releases that "
        "have it; *exact*: of those in the declared range, how many pass (every real token within 1e-5 of "
        "its row run alone); stock and hfpatch: the largest max|diff| over the scenarios on "
        f"{newest}.",
    ]
    in_range_cells = [
        by_release.get(release, "absent")
        for name, adapter in REGISTRY.items()
        for model_type in (name, *adapter.aliases)
        for release, by_release in [(r, verdicts.get(model_type, {})) for r in probed]
        if _patched_on(adapter, release, model_type) and by_release.get(release, "absent") != "absent"
    ]
    passed = sum(1 for verdict in in_range_cells if verdict == "pass")
    left = Counter(
        failure_kind(summary[release]["probe"].get(name, {}))
        for name, adapter in REGISTRY.items()
        for release in probed
        if not _patched_on(adapter, release) and verdicts.get(name, {}).get(release) == "fail"
    )
    why = "; ".join(f"{n} {kind}" for kind, n in sorted(left.items())) or "none"
    lines += [
        "",
        f"**{passed} of {len(in_range_cells)} (model type, release) pairs in the declared ranges pass: "
        f"{passed} patched cells.** Where a class ships and is not patched (below its range, or a known-bad "
        f"or unverified release inside it), the probe says why: {why}. *wrong with the positions*: hfpatch "
        "patched it and it is still wrong (a limit of that release); *a scenario fails on stock too*: "
        "transformers raises there, with or without hfpatch (e.g. a cache the model makes itself, sized to "
        "the prompt); *right on stock there*: nothing to patch; *class differs*: that release's class is "
        "not the one hfpatch patches (or the patch raises where stock runs); *tiny model does not run*: "
        "nothing could be measured there. Every release where the probe passes is patched "
        "(`tests/test_compat_report.py` checks it).",
    ]
    families: dict = {}
    for name, adapter in REGISTRY.items():
        families.setdefault(adapter.family.name, []).append((name, adapter))
    for family, members in families.items():
        count = sum(1 + len(a.aliases) for _, a in members)
        lines += ["", f"### Family `{family}` ({count} model types)", ""]
        lines += [
            "| model type | class | declared | ships | exact | not patched, and why | stock | hfpatch |",
            "|---" * 8 + "|",
        ]
        for name, adapter in members:
            for model_type in (name, *adapter.aliases):
                by_release = verdicts.get(model_type, {})
                ships = [r for r, v in by_release.items() if v != "absent"]
                declared = [r for r in ships if _patched_on(adapter, r, model_type)]
                passed_here = [r for r in declared if by_release[r] == "pass"]
                newest_run = summary[newest]["probe"].get(model_type, {})
                stock = max((run.get("stock", 0.0) for run in newest_run.values()), default=None)
                fixed = max((run.get("hfpatch", 0.0) for run in newest_run.values()), default=None)
                span = f"{ships[0]} - {ships[-1]} ({len(ships)})" if ships else "-"
                holes = "".join(f", not {spec}" for spec, _ in (*adapter.known_bad, *adapter.unverified))
                cells = [
                    model_type,
                    adapter.cls,
                    adapter.versions + holes,
                    span,
                    f"{len(passed_here)}/{len(declared)}",
                ]
                cells += [
                    _not_patched(summary, adapter, model_type, by_release) or "-",
                    _num(stock),
                    _num(fixed),
                ]
                lines.append("| " + " | ".join(cells) + " |")
    return lines


def _render_packed(summary: dict) -> list[str]:
    """Packed rows (tests/test_architectures.py's packed test): per model type, the releases where each
    packed sequence is exact, where hfpatch declares them not kept (stock's results), where wrong."""
    title = "## Packed rows: the probe on every release"
    probed = [r for r, e in summary.items() if e["packed"]]
    if not probed:
        command = "PROBE_TESTS=tests/test_architectures.py PROBE_K=packed PROBE_TAG=packed"
        command += " bash compat/probe_matrix.sh"
        return ["", title, "", f"No packed-rows probe results yet: run `{command}`."]
    newest = probed[-1]
    rows, kept_total, declared_total, wrong = [], 0, 0, []
    for name, adapter in REGISTRY.items():
        for model_type in (name, *adapter.aliases):
            by_kind: dict = {}
            for release in probed:
                runs = summary[release]["packed"].get(model_type)
                if not runs or not _patched_on(adapter, release, model_type):
                    continue
                outcome = probe_verdict(runs)
                if outcome == "fail":
                    kind = failure_kind(runs)
                    wrong.append(f"{model_type} on {release}")
                elif outcome == "pass":
                    kind = (
                        NOT_KEPT
                        if all(NOT_KEPT in run["kinds"] for run in runs.values() if run["outcome"] == "pass")
                        else "kept"
                    )
                else:
                    continue
                by_kind.setdefault(kind, []).append(release)
            if not by_kind:
                continue
            kept, declared = by_kind.pop("kept", []), by_kind.pop(NOT_KEPT, [])
            kept_total, declared_total = kept_total + len(kept), declared_total + len(declared)
            newest_runs = summary[newest]["packed"].get(model_type, {})
            numbers = [
                max((run[n] for run in newest_runs.values() if n in run), default=None)
                for n in ("stock", "hfpatch")
            ]
            cells = [model_type, _spans(kept, probed), _spans(declared, probed),
                     "; ".join(f"{kind}: {_spans(rs, probed)}" for kind, rs in by_kind.items()) or "-",
                     *(_num(value) for value in numbers)]  # fmt: skip
            rows.append("| " + " | ".join(cells) + " |")
    return [
        "",
        title,
        "",
        f"`tests/test_architectures.py::test_packed_rows_covered_architecture` on {len(probed)} releases "
        f"({probed[0]} to {newest}), eager and SDPA: rows that pack three or four sequences, positions "
        "restarting (no mask, an all-ones mask, two right-padded rows), each sequence against itself run "
        "alone on stock. *kept*: `status()` says hfpatch keeps them and every real token is within the "
        "tolerance (1e-5, or four times the model's own fp32 noise at these lengths); *not kept*: `status()` "
        "says it cannot there (its reason), and the results are stock's, bit for bit; anything else is a "
        "failure (*wrong with the positions*: claimed and wrong). Releases in each model type's declared "
        f"range only; stock and hfpatch: the largest max|diff| on {newest}.",
        "",
        f"**(model type, release) pairs: {kept_total} kept and exact, {declared_total} declared not kept, "
        f"{len(wrong)} wrong{': ' + ', '.join(wrong) if wrong else ''}.**",
        "",
        "| model type | kept (exact) | not kept (declared) | failing | stock | hfpatch |",
        "|---" * 6 + "|",
        *rows,
    ]


# the probe types of tests/test_custom_models.py (custom-KIND), in the report's order: what each model is
CUSTOM_MODELS = {
    "custom-gpt2": "the release's GPT-2 files, every class renamed (learned absolute positions)",
    "custom-llama": "the release's Llama files, renamed (rotary)",
    "custom-qwen2": "the release's Qwen2 files, renamed (rotary, sliding-window config)",
    "custom-from-scratch": "a causal LM written from scratch (learned absolute positions, DynamicCache)",
    "custom-offset-positions": "the from-scratch LM, positions from the mask counted from 1: left alone",
    "custom-no-position_ids": "the from-scratch LM without position_ids: listed, left alone",
}


def custom_verdict(runs: dict) -> str:
    """One release's probe of a custom model (its tests' cell): ``pass``, ``fail``, or why none ran (the
    first of :data:`compat.vocabulary.CUSTOM_SKIP_KINDS` its tests recorded)."""
    outcomes = {run["outcome"] for run in runs.values()}
    if "fail" in outcomes or "pass" in outcomes:
        return "fail" if "fail" in outcomes else "pass"
    kinds = set().union(*(run["kinds"] for run in runs.values()))
    return next((kind for kind in CUSTOM_SKIP_KINDS if kind in kinds), "skipped")


def custom_verdicts(summary: dict) -> dict:
    """{custom probe type: {release: custom_verdict}} over the releases that probed it."""
    verdicts: dict = {}
    for release, entry in summary.items():
        for model_type, runs in entry["probe"].items():
            if model_type.startswith(CUSTOM):
                verdicts.setdefault(model_type, {})[release] = custom_verdict(runs)
    return verdicts


def _render_custom(summary: dict) -> list[str]:
    """Models outside transformers' classes (tests/test_custom_models.py): one row per kind."""
    verdicts = custom_verdicts(summary)
    title = "## Models outside transformers' classes"
    if not verdicts:
        return ["", title, "", "No probe results yet: run `bash compat/probe_matrix.sh`."]
    types = [t for t in CUSTOM_MODELS if t in verdicts] + sorted(set(verdicts) - set(CUSTOM_MODELS))
    probed = [r for r in summary if any(r in by_release for by_release in verdicts.values())]
    newest = probed[-1]
    lines = [
        "",
        f"{title}: the probe on every release",
        "",
        f"`tests/test_custom_models.py` on {len(probed)} releases ({probed[0]} to {newest}): models hfpatch "
        "recognises from their `forward` (`hfpatch/custom.py`), not from transformers' classes. The copies "
        "are the release's own modeling files with every class renamed, each registered through the Auto "
        "classes and loaded from a checkpoint directory with `trust_remote_code=True`, with `apply()` "
        "before the classes exist and after the model is built (four tests a release); each must be exact "
        "with hfpatch for left padding, a right-padded cached prefix + 1 token and holes, against each row "
        "run alone on stock transformers, be patched (`status()`) and pass `hfpatch.verify`. The last two "
        "must be left alone (not patched, stock's results). *runs*: the releases where a test of it ran; "
        "*passes*: of those, how many pass every test (exact, or left alone); *not run or not passing, "
        "and why*: the other releases by the kind the tests recorded, and releases where some tests "
        "skipped while the others ran (*some tests*); stock and hfpatch: the largest max|diff| against "
        f"the rows alone on {newest} (for the left-alone rows, hfpatch's side is stock's code too).",
    ]
    rows, runs_total, passes_total, wrong = [], 0, 0, []
    for model_type in types:
        by_release = verdicts[model_type]
        ran = [r for r, v in by_release.items() if v in ("pass", "fail")]
        passed = [r for r in ran if by_release[r] == "pass"]
        runs_total, passes_total = runs_total + len(ran), passes_total + len(passed)
        groups: dict = {}
        for release, verdict in by_release.items():
            runs = summary[release]["probe"][model_type]
            kinds = set().union(*(run["kinds"] for run in runs.values()))
            if verdict == "fail":
                reason = failure_kind(runs)
                groups.setdefault(reason, []).append(release)
                if reason == WRONG_WITH_POSITIONS:
                    wrong.append(f"{model_type} on {release}")
            elif verdict != "pass":
                groups.setdefault(verdict, []).append(release)
            for kind in CUSTOM_SKIP_KINDS:
                if kind in kinds and verdict in ("pass", "fail"):
                    groups.setdefault(f"{kind} (some tests)", []).append(release)
        newest_runs = summary[newest]["probe"].get(model_type, {})
        numbers = [
            max((run[name] for run in newest_runs.values() if name in run), default=None)
            for name in ("stock", "hfpatch")
        ]
        cells = [
            f"`{model_type}`",
            CUSTOM_MODELS.get(model_type, "-"),
            _spans(ran, probed),
            f"{len(passed)}/{len(ran)}",
            "; ".join(f"*{why}*: {_spans(rs, probed)}" for why, rs in groups.items()) or "-",
            *(_num(value) for value in numbers),
        ]
        rows.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        f"**{passes_total} of {runs_total} (custom model, release) pairs where it runs pass; patched by "
        f"hfpatch and still wrong: {', '.join(wrong) or 'none'}.** Why a release does not pass, as the "
        f"tests recorded it: *{NOT_PATCHED}*: hfpatch left stock a model it should patch (not recognised, "
        "or its check on a tiny copy refused it: `status()` says why; its results are stock's; like a "
        "release outside a declared range, not counted in the headline, and `tests/test_compat_report.py` "
        "names each); "
        f"*{WRONG_WITH_POSITIONS}*: hfpatch patched it and it is still wrong; *{NOT_BUILDABLE}*: the test "
        f"failed before measuring (the copy did not build or load). Why one does not run: *{ABSENT}*: the "
        f"release has no such model to copy; *{NO_CACHE_CLASS}*: no `transformers.DynamicCache` (the "
        f"from-scratch LM's cache); *{NOT_REMOTE_CODE}*: transformers refuses the copy's file as remote "
        "code, or loads it with weights left on the meta device, hfpatch or not (the remote-code tests).",
        "",
        "| custom model | what it is | runs | passes | not run or not passing, and why | stock | hfpatch |",
        "|---" * 7 + "|",
        *rows,
    ]
    return lines


def _spans(releases: list, order: list) -> str:
    """``releases`` as runs of consecutive ones in ``order``: "4.36.2 - 4.37.2 (2), 5.3.0"."""
    if not releases:
        return "-"
    index = {release: i for i, release in enumerate(order)}
    runs: list = []
    for release in sorted(releases, key=index.__getitem__):
        if runs and index[release] == index[runs[-1][-1]] + 1:
            runs[-1].append(release)
        else:
            runs.append([release])
    return ", ".join(run[0] + (f" - {run[-1]} ({len(run)})" if len(run) > 1 else "") for run in runs)


def _not_patched(summary: dict, adapter, model_type: str, by_release: dict) -> str:
    """Releases that ship the model type and where it is not patched, grouped by the probe's reason."""
    groups: dict = {}
    for release, verdict in by_release.items():
        if verdict == "fail" and not _patched_on(adapter, release, model_type):
            groups.setdefault(failure_kind(summary[release]["probe"][model_type]), []).append(release)
    return "; ".join(
        f"{kind}: {rs[0]}" + (f" - {rs[-1]} ({len(rs)})" if len(rs) > 1 else "")
        for kind, rs in groups.items()
    )


def _patched_on(adapter, release: str, model_type: str = "") -> bool:
    """In the declared range and neither known-bad nor unverified there (``tested``); for an alias verified
    from a later release (``alias_since``), from there."""
    since = dict(adapter.alias_since).get(model_type)
    if since is not None and Version(release) < Version(since):
        return False
    return support(adapter, Version(release)).level == TESTED


def _commits(summary: dict) -> str:
    """The commits whose code the evidence comes from, with how many releases each ran on, and the
    runtime changes (commits to ``hfpatch/``) each is behind the newest of them."""
    counts: Counter = Counter()
    for entry in summary.values():
        for commit in dict.fromkeys([*entry["code"].get("suite", []), *entry["code"].get("probe", [])]):
            counts[commit] += 1
    if not counts:
        return "(not recorded)"
    behind = _runtime_commits_behind(list(counts))
    newest = min(behind, key=behind.get) if behind else None
    cells = []
    for commit, n in counts.items():
        after = behind.get(commit)
        later = ""
        if after is not None and commit != newest:
            later = f", {after} runtime commit{'' if after == 1 else 's'} before `{newest}`"
        cells.append(f"`{commit}` ({n}{later})")
    return ", ".join(cells)


def release_commits(entry: dict) -> list[str]:
    """The commits a release's evidence was measured at (its suite's, then its probe's)."""
    return list(dict.fromkeys([*entry["code"].get("suite", []), *entry["code"].get("probe", [])]))


def one_commit(summary: dict) -> tuple[str | None, dict[tuple[str, ...], list[str]]]:
    """The commit most releases were measured at alone (else the most common), and the stragglers:
    {their commits: releases} for every release with evidence not at that one commit alone."""
    measured = {release: release_commits(entry) for release, entry in summary.items() if entry["code"]}
    alone = Counter(commits[0] for commits in measured.values() if len(commits) == 1)
    anywhere = Counter(commit for commits in measured.values() for commit in commits)
    main = (alone or anywhere).most_common(1)[0][0] if anywhere else None
    stragglers: dict = {}
    for release, commits in measured.items():
        if commits != [main]:
            stragglers.setdefault(tuple(commits), []).append(release)
    return main, stragglers


def _one_commit(summary: dict) -> list[str]:
    """Whether every release was measured at one commit (loudly when not), and what ran on SAMPLE only."""
    main, stragglers = one_commit(summary)
    measured = [r for r, e in summary.items() if e["code"]]
    if main is None:
        return ["**NOT AT ONE COMMIT: no release's commit is recorded.**"]
    if not stragglers:
        lines = [f"**At one commit: `{main}`**, all {len(measured)} releases with evidence (the probe, the "
                 "suite and the case count of each)."]  # fmt: skip
    else:
        late = sum(len(releases) for releases in stragglers.values())
        groups = "; ".join(
            f"{_spans(releases, RELEASES)} at "
            + (f"`{commits[0]}`" if len(commits) == 1 else f"{len(commits)} commits")
            for commits, releases in stragglers.items()
        )
        lines = [f"**NOT AT ONE COMMIT: {late} of {len(measured)} releases are not at `{main}` alone: "
                 f"{groups}.**"]  # fmt: skip
        every = sorted({commit for commits in [[main], *stragglers] for commit in commits})
        behind = _runtime_commits_behind(every)
        if behind and not any(behind.values()):  # (what differs between them is tests and documents)
            lines += ["", f"No commit between these {len(every)} changes `hfpatch/`: every release ran the "
                      "same runtime code; they differ in tests and documents."]  # fmt: skip
    sample = [r for r, e in summary.items() if e["run"].get("ran") == "whole suite"]
    per_release = [r for r, e in summary.items() if e["run"].get("ran") == "per release"]
    once = ", ".join(f"`{path}`" for path in ONCE)
    smoke = ", ".join(f"`{test.partition('::')[2]}`" for test in COMPILE_SMOKE)
    lines += [
        "",
        f"Mechanics run on SAMPLE only ({', '.join(SAMPLE)}; `compat/matrix.py`): {once}, and the tests "
        f"marked {', '.join(ONCE_MARKERS)} but the compile smoke ({smoke}), and the parameters "
        f"{', '.join(ONCE_PARAMETERS)}; the probe's "
        + "; ".join(
            f"`{name.partition('::')[2]}`" + (f" before {before}" if before else "") + f" ({why})"
            for name, (before, why) in PROBE_ONCE.items()
        )
        + "; every other test, and the rest of the probe, on every release. *ran* column: *whole suite* "
        "(a SAMPLE release, "
        f"{_spans(sample, RELEASES) if sample else 'none yet'}), *per release* "
        f"({_spans(per_release, RELEASES) if per_release else 'none yet'}), *-* (an earlier "
        "run of the whole suite, before the split).",
    ]
    return lines


def _code(entry: dict) -> str:
    """A release's commits, for its row: the one, or the first and how many more."""
    commits = release_commits(entry)
    if not commits:
        return "-"
    return f"`{commits[0]}`" + (f" +{len(commits) - 1}" if len(commits) > 1 else "")


def _runtime_commits_behind(commits: list[str]) -> dict[str, int]:
    """For each of ``commits``: how many commits that change ``hfpatch/`` lie between it and the newest of
    them (git history; empty where it cannot be read, as in a copy without it)."""
    import subprocess

    def count(revisions: str) -> int | None:
        done = subprocess.run(["git", "rev-list", "--count", revisions, "--", "hfpatch"], cwd=HERE.parent,
                              capture_output=True, text=True)  # fmt: skip
        return int(done.stdout) if done.returncode == 0 and done.stdout.strip().isdigit() else None

    ahead = {commit: count(commit) for commit in commits}  # runtime commits up to each
    if any(value is None for value in ahead.values()):
        return {}
    top = max(ahead.values())
    return {commit: top - value for commit, value in ahead.items()}


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"


def _wrong(count: dict, name: str) -> str:
    errors = count.get(f"{name}_errors", 0)
    crashed = f" ({errors} crashed)" if errors else ""
    return f"{count[f'{name}_wrong']}/{count['cases']}{crashed}"


def main(argv: list[str]) -> int:
    text = render(build())
    path = HERE / "REPORT.md"
    if argv == ["--check"]:
        if path.read_text() != text:
            print("compat/REPORT.md is not what compat/evidence/ gives: run python compat/report.py")
            return 1
        return 0
    path.write_text(text)
    print(f"compat/REPORT.md: {sum(e['ran'] for e in build().values())} of {len(RELEASES)} releases")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
