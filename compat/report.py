"""Turn compat/results/ (JUnit XML + case counts per release) into compat/REPORT.md and compat/summary.json.

    python compat/report.py

Each test belongs to one invariant (by module and name) and, through its parameter id, to one
architecture. A cell is ``pass`` when every test of it passed (some may skip), ``FAIL`` when one
failed, ``n/a`` when all skipped (the reason is footnoted), ``known-bad`` where the adapter declares
the release known-bad.
"""

from __future__ import annotations

import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from packaging.version import Version  # noqa: E402

from hfpatch import engine  # noqa: E402  (registers the adapters)
from hfpatch.gates import KNOWN_BAD, support, upstream_bugs_on  # noqa: E402

ARCHS = list(engine._registry)
INVARIANTS = [  # (column, what it checks, (module, test-name prefix) pairs)
    ("I1", "padding / cache-split equivalence", [("test_seed_scenarios", ""), ("test_invariant", "")]),
    ("I2", "explicit inputs unchanged", [("test_unchanged", "test_explicit_")]),
    (
        "I3",
        "no mask (or 4-D mask) unchanged",
        [
            ("test_unchanged", "test_no_mask"),
            ("test_unchanged", "test_4d_mask"),
            ("test_unchanged", "test_gpt2_"),
        ],
    ),
    ("I4", "generate unchanged", [("test_unchanged", "test_generate")]),
    ("I5", "cache_position optional", [("test_cache_position", "")]),
    ("I6", "torch.compile", [("test_compile", "")]),
    ("I7", "lifecycle and errors", [("test_lifecycle", ""), ("test_bad_input", "")]),
]


def invariant_of(module: str, name: str) -> str | None:
    for column, _, patterns in INVARIANTS:
        if any(module.endswith(mod) and name.startswith(prefix) for mod, prefix in patterns):
            return column
    return None


def arch_of(name: str) -> str | None:
    params = name.partition("[")[2].rstrip("]").split("-")
    return next((p for p in params if p in ARCHS), None)


def read_junit(path: Path) -> list[tuple[str, str, str, str]]:
    """(module, test name, outcome, skip message) for every test case."""
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "pass", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "fail"
            elif child.tag == "skipped" and outcome != "fail":
                outcome, message = "skip", child.get("message", "")
        cases.append((case.get("classname", ""), case.get("name", ""), outcome, message))
    return cases


def cells(cases: list[tuple[str, str, str, str]]) -> dict:
    """{arch or "any": {invariant: (state, reason)}}."""
    grouped: dict = {}
    for module, name, outcome, message in cases:
        column = invariant_of(module, name) or "other"
        grouped.setdefault(arch_of(name) or "any", {}).setdefault(column, []).append((outcome, message))
    result: dict = {}
    for arch, columns in grouped.items():
        for column, outcomes in columns.items():
            states = [o for o, _ in outcomes]
            if "fail" in states:
                cell = ("fail", "")
            elif "pass" in states:
                cell = ("pass", "")
            else:
                cell = ("n/a", _clean(outcomes[0][1]))
            result.setdefault(arch, {})[column] = cell
    return result


def _clean(message: str) -> str:
    """One footnote per reason, not per release: the release number becomes "this release"."""
    message = message.removeprefix("Skipped: ").strip()
    return re.sub(r"(transformers |installed: )\d+\.\d+\.\d+", r"\1this release", message)


def build() -> dict:
    releases = [
        line.strip()
        for line in (HERE / "releases.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    summary: dict = {}
    for release in releases:
        junit = HERE / "results" / f"{release}.xml"
        counts = HERE / "results" / f"{release}.cases.json"
        entry: dict = {"ran": junit.exists()}
        if junit.exists():
            cases = read_junit(junit)
            entry["tests"] = {o: sum(1 for c in cases if c[2] == o) for o in ("pass", "fail", "skip")}
            entry["cells"] = cells(cases)
        if counts.exists():
            entry["cases"] = json.loads(counts.read_text())
        summary[release] = entry
    return summary


def render(summary: dict) -> str:
    footnotes: list[str] = []

    def footnote(reason: str) -> int:
        if reason not in footnotes:
            footnotes.append(reason)
        return footnotes.index(reason) + 1

    def note(reason: str) -> str:
        return f"n/a<sup>{footnote(reason)}</sup>"

    def show(cell: list | None) -> str:
        if cell is None:
            return "-"
        state, reason = cell
        if state == "n/a":
            return note(reason)
        return {"pass": "pass", "fail": "**FAIL**"}[state]

    ran = [r for r, e in summary.items() if e["ran"]]
    failing = [r for r in ran if summary[r]["tests"]["fail"]]
    stock_wrong = sum(c.get("stock_wrong", 0) for r in ran for c in summary[r].get("cases", {}).values())
    patched_wrong = sum(c.get("hfpatch_wrong", 0) for r in ran for c in summary[r].get("cases", {}).values())
    total_cases = sum(c.get("cases", 0) for r in ran for c in summary[r].get("cases", {}).values())
    headline = (
        f"**{len(ran)} of {len(summary)} releases tested; {len(ran) - len(failing)} pass every applicable "
        "check. "
        f"Randomized padding/cache-split cases: {stock_wrong} of {total_cases} wrong on stock transformers, "
        f"{patched_wrong} with hfpatch.**"
    )
    lines = [
        "# hfpatch compatibility report",
        "",
        "Generated by `python compat/report.py` from `compat/results/`, made by `bash compat/run_matrix.sh`:",
        "one virtualenv per release with torch 2.13.0 CPU, the test suite with the `matrix` hypothesis",
        "profile and without the inductor test, one torch thread. Do not edit by hand.",
        "",
        headline,
        "",
        "Invariants: " + "; ".join(f"**{c}** {what}" for c, what, _ in INVARIANTS) + ".",
        "",
    ]
    header = ["release"] + [f"{arch} {c}" for arch in ARCHS for c, _, _ in INVARIANTS] + ["general"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for release, entry in summary.items():
        if not entry["ran"]:
            lines.append(f"| {release} | " + " | ".join(["not run"] * (len(header) - 1)) + " |")
            continue
        row = [release]
        for arch in ARCHS:
            verdict = support(engine._registry[arch], Version(release))
            if verdict.level == KNOWN_BAD:
                row += [f"known-bad<sup>{footnote(verdict.reason)}</sup>"] * len(INVARIANTS)
                continue
            row += [show(entry["cells"].get(arch, {}).get(c)) for c, _, _ in INVARIANTS]
        general = entry["cells"].get("any", {})
        row.append("**FAIL**" if any(s == "fail" for s, _ in general.values()) else "pass")
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
            count = entry.get("cases", {}).get(arch, {})
            if "cases" in count:
                bugs = upstream_bugs_on(engine._registry[arch], Version(release))
                marks = "".join(f"<sup>{footnote(f'upstream bug ({arch}): {why}')}</sup>" for why in bugs)
                row += [_wrong(count, "stock"), _wrong(count, "hfpatch") + marks]
            else:
                row += ["n/a", "n/a"]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "## Notes: why a cell is n/a, known-bad or marked", ""]
    lines += [f"{i + 1}. {reason}" for i, reason in enumerate(footnotes)]
    return "\n".join(lines) + "\n"


def _wrong(count: dict, name: str) -> str:
    errors = count.get(f"{name}_errors", 0)
    crashed = f" ({errors} crashed)" if errors else ""
    return f"{count[f'{name}_wrong']}/{count['cases']}{crashed}"


def main() -> None:
    summary = build()
    (HERE / "summary.json").write_text(json.dumps(summary, indent=1, sort_keys=False) + "\n")
    (HERE / "REPORT.md").write_text(render(summary))
    ran = sum(e["ran"] for e in summary.values())
    print(f"compat/REPORT.md: {ran} of {len(summary)} releases with results")


if __name__ == "__main__":
    main()
