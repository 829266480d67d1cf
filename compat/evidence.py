"""The committed evidence of the release matrix: compat/evidence/RELEASE.json, one small file per
release, made from the JUnit XML the matrix runs write (compat/results/, build output, not committed).

    python compat/evidence.py RELEASE FILE.xml [...]           # merge full-suite runs into RELEASE's
    python compat/evidence.py --probe RELEASE FILE.xml [...]   # merge probe runs (their probe tests)
    python compat/evidence.py --cases RELEASE FILE.json        # the stock-vs-hfpatch case counts
    python compat/evidence.py --at-commit RELEASE              # the commit a one-commit run measured

A run's commit is read from FILE.commit beside it (the matrix scripts write it). The one-commit matrix
(``python compat/matrix.py run RELEASE``, compat/one_commit.sh) rebuilds a release's file from its own
runs alone (:func:`restart`): its ``run`` says the commit and whether the release ran the whole suite
(a SAMPLE release) or the per-release tests only.

What a test found is read from the JUnit properties the tests record, never from names or messages:

- a release-probe test (tests/probes.py) records ``probe_type``, ``attention``, ``kind`` (``exact`` or
  why not, compat/vocabulary.py) and the largest ``stock`` and ``hfpatch`` differences;
- a full-suite test records ``invariant`` (its marker: the report's column) and ``arch`` (its flagship).

A model type the release does not ship leaves no row (its absence is the default; a custom model's
absence, where there is nothing to copy, is kept). Each file holds every test's last result, test by
test: a later run's result of a test replaces the earlier one's, a skip replaces nothing, so a partial
re-run leaves the other tests' results standing.
Numbers are rounded to two significant digits and keys sorted: the same results give the same bytes.
"""

from __future__ import annotations

import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
FOLDER = HERE / "evidence"
sys.path.insert(0, str(HERE.parent))

from compat.vocabulary import ABSENT, CUSTOM, ProbeRow, SuiteRow, as_list  # noqa: E402


def read_junit(path: Path) -> list[dict[str, Any]]:
    """One record per test case: ``test`` (file::name[params]), ``outcome`` (pass, fail, skip), the skip
    message (for the report's footnotes, shown as it is), and the recorded properties."""
    records = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "pass", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "fail"
            elif child.tag == "skipped" and outcome != "fail":
                outcome, message = "skip", _clean(child.get("message", ""))
        module = case.get("classname", "").rpartition(".")[2] or "-"
        properties = {p.get("name"): p.get("value") for p in case.iter("property")}
        records.append({"test": f"{module}::{case.get('name')}", "outcome": outcome, "message": message,
                        "properties": properties})  # fmt: skip
    return records


def _clean(message: str) -> str:
    """One footnote per reason, not per release: the release number becomes "this release"."""
    message = message.removeprefix("Skipped: ").strip()
    return re.sub(r"(transformers |installed: )\d+\.\d+\.\d+", r"\1this release", message)


def load(release: str) -> dict[str, Any]:
    path = FOLDER / f"{release}.json"
    if path.exists():
        return json.loads(path.read_text())
    return {"release": release, "code": {"probe": [], "suite": []}, "reasons": [], "probe": {}, "suite": {}}


def restart(release: str, commit: str, sample: bool) -> dict[str, Any]:
    """A release's evidence begun anew by a one-commit run: nothing of earlier runs is kept."""
    evidence = load("")  # the empty file
    evidence["release"] = release
    evidence["run"] = {"commit": commit, "ran": "whole suite" if sample else "per release"}
    return evidence


def collapse_suite(evidence: dict[str, Any]) -> dict[str, Any]:
    """A one-commit file's suite, compact (the committed evidence stays small: tests/test_compat_report.py):
    per test function, one entry per distinct result, keyed by its flagship, invariant, outcome and how
    many tests gave it ("gpt2 I1 pass x12"). The report reads nothing finer (a cell is its tests' worst,
    or its skips' reason); each test's own result is in the run's JUnit XML (compat/results/). Unused skip
    reasons are dropped, and so are the skips of a column (flagship, invariant) where some test ran: the
    cell is then what ran."""
    ran = {(row[1], row[2]) for entries in evidence["suite"].values() for row in entries.values()
           if not isinstance(row[0], int)}  # fmt: skip
    used: dict[int, int] = {}
    grouped: dict[str, dict[tuple, int]] = {}
    for function, entries in evidence["suite"].items():
        counts = grouped.setdefault(function, {})
        for row in entries.values():
            if isinstance(row[0], int) and (row[1], row[2]) in ran:
                continue
            counts[tuple(row)] = counts.get(tuple(row), 0) + 1
            if isinstance(row[0], int):
                used.setdefault(row[0], len(used))
    reasons = [evidence["reasons"][index] for index in sorted(used, key=used.get)]
    suite: dict[str, dict[str, list]] = {}
    for function, counts in grouped.items():
        for row, count in counts.items():  # a function none of whose rows is kept is left out
            outcome = f"skip{used[row[0]]}" if isinstance(row[0], int) else row[0]
            row = (used[row[0]], *row[1:]) if isinstance(row[0], int) else row
            key = f"{row[1] or '-'} {row[2] or '-'} {outcome} x{count}"
            suite.setdefault(function, {})[key] = list(row)
    evidence["suite"], evidence["reasons"] = suite, reasons
    return evidence


def at_commit(release: str) -> Optional[str]:
    """The commit a one-commit run measured ``release`` at (None: not such a run, or mixed)."""
    evidence = load(release)
    commit = evidence.get("run", {}).get("commit")
    code = evidence.get("code", {})
    if commit and code.get("probe") == [commit] and code.get("suite") == [commit] and evidence.get("cases"):
        return commit
    return None


def merge(
    evidence: dict[str, Any], records: list[dict[str, Any]], commit: Optional[str], probe_only: bool = False
) -> dict[str, Any]:
    """``records`` (one run, :func:`read_junit`) over ``evidence``, test by test; ``commit``: the code
    the run tested; ``probe_only``: a probe run (``--outside-ranges``), whose other tests are not the
    suite's evidence."""
    sections = set()
    for record in records:
        properties = record["properties"]
        section = "probe" if "probe_type" in properties else "suite"
        if probe_only and section != "probe":
            continue
        function, _, params = record["test"].partition("[")
        entries = evidence[section].setdefault(function, {})
        key = params.removesuffix("]") or "-"
        if record["outcome"] == "skip" and key in entries:
            continue  # a skip replaces nothing
        sections.add(section)
        if section == "probe" and _absent(properties):  # (no row: a release without the type, the default)
            entries.pop(key, None)
            continue
        if section == "probe":  # the kind says the outcome
            row: tuple = ProbeRow(
                properties["probe_type"], properties.get("attention", "eager"), properties.get("kind", ""),
                _number(properties.get("stock")), _number(properties.get("hfpatch")),
            )  # fmt: skip
        else:  # a skip: the index of its reason in "reasons"
            outcome = (
                _reason(evidence, record["message"]) if record["outcome"] == "skip" else record["outcome"]
            )
            row = SuiteRow(outcome, properties.get("arch", ""), properties.get("invariant", ""))
        entries[key] = as_list(row)
    for section in sorted(sections):
        if commit and commit not in evidence["code"][section]:
            evidence["code"][section].append(commit)
    return evidence


def _absent(properties: dict) -> bool:
    """A probe of a model type the release does not ship (not a custom model's: its absence is a finding)."""
    return properties.get("kind") == ABSENT and not properties["probe_type"].startswith(CUSTOM)


def _reason(evidence: dict[str, Any], message: str) -> int:
    message = message if len(message) <= 160 else message[:157] + "..."
    reasons = evidence["reasons"]
    if message not in reasons:
        reasons.append(message)
    return reasons.index(message)


def _number(value: Optional[str]) -> Optional[float]:
    return None if value in (None, "") else float(f"{float(value):.2g}")


def dumps(evidence: dict[str, Any]) -> str:
    """The file's text: one test function a line group, one entry a line, keys sorted."""
    lines = ["{"]
    head = {key: evidence[key] for key in ("release", "source", "run", "code", "cases") if key in evidence}
    for key, value in head.items():
        lines.append(f" {json.dumps(key)}: {json.dumps(value, sort_keys=True)},")
    reasons = ",\n".join(f"  {json.dumps(reason)}" for reason in evidence["reasons"])
    lines.append(f' "reasons": [\n{reasons}\n ],' if reasons else ' "reasons": [],')
    for section in ("probe", "suite"):
        lines.append(f" {json.dumps(section)}: {{")
        functions = sorted(evidence[section])
        for i, function in enumerate(functions):
            entries = evidence[section][function]
            lines.append(f"  {json.dumps(function)}: {{")
            keys = sorted(entries)
            for j, key in enumerate(keys):
                comma = "," if j < len(keys) - 1 else ""
                lines.append(f"   {json.dumps(key)}: {json.dumps(entries[key])}{comma}")
            lines.append("  }" + ("," if i < len(functions) - 1 else ""))
        lines.append(" }" + ("," if section == "probe" else ""))
    lines.append("}")
    return "\n".join(lines) + "\n"


def save(evidence: dict[str, Any]) -> Path:
    FOLDER.mkdir(exist_ok=True)
    path = FOLDER / f"{evidence['release']}.json"
    path.write_text(dumps(evidence))
    return path


def main(argv: list[str]) -> int:
    if argv[:1] == ["--at-commit"] and len(argv) == 2:  # the commit a one-commit run measured it at
        print(at_commit(argv[1]) or "")
        return 0
    if argv[:1] == ["--cases"] and len(argv) == 3:
        evidence = load(argv[1])
        evidence["cases"] = json.loads(Path(argv[2]).read_text())
        print(save(evidence))
        return 0
    probe_only = argv[:1] == ["--probe"]
    argv = argv[1:] if probe_only else argv
    if len(argv) < 2:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    release, files = argv[0], [Path(name) for name in argv[1:]]
    evidence = load(release)
    for path in files:
        commit_file = path.with_suffix(".commit")
        commit = commit_file.read_text().strip() if commit_file.exists() else None
        merge(evidence, read_junit(path), commit, probe_only)
    print(save(evidence))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
