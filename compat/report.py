"""Turn compat/results/ into compat/REPORT.md and compat/summary.json.

    python compat/report.py

Two kinds of results per release: the full test suite on the flagship architectures (JUnit XML and
case counts, from ``nox -s matrix``), and the architecture probe (``compat/results/probe/``, from
``compat/probe_matrix.sh``: ``hfpatch.verify`` on every covered model type the release ships, in
its declared range or not; ``RELEASE.TAG.xml``: a partial re-run for some model types). The full
suite includes the probe for the model types in range. Per cell, a partial re-run's result replaces
the probe run's, and the full suite's replaces both.

Full suite: each test belongs to one invariant (by module and name) and, through its parameter id,
to one architecture. A cell is ``pass`` when every test of it passed (some may skip), ``FAIL`` when
one failed, ``n/a`` when all skipped (the reason is footnoted), ``known-bad`` where the adapter
declares the release known-bad. Probe: one row per model type, grouped by family.
"""

from __future__ import annotations

import json
import re
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "tests"))

from packaging.version import Version  # noqa: E402

import hfpatch  # noqa: E402  (registers the adapters)
from hfpatch.support import KNOWN_BAD, TESTED, support  # noqa: E402

from expectations import FLAGSHIPS  # noqa: E402
from matrix import FAILURE_KINDS, NOT_BUILDABLE, RELEASES, failure_kind, probe_verdict  # noqa: E402

# every adapter: the probe runs causal LMs and encoder-decoder models alike (hfpatch.verify)
REGISTRY = dict(hfpatch.registry())
ARCHS = list(FLAGSHIPS)  # the full suite's columns
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


# the probe's tests, by name: hfpatch.verify on a causal LM (tests/test_architectures.py), an
# encoder-decoder model's decoder and encoder (tests/test_decoders.py), a vision-language model's text and
# image paths (tests/test_wrappers.py); each test id starts "MODEL_TYPE" or "MODEL_TYPE-ATTENTION"
PROBE_TESTS = (
    "test_verify_covered_architecture",
    "test_decoder_rows_equal_themselves_alone",
    "test_decoder_with_a_static_cache_rows_equal_themselves_alone",
    "test_decoder_window_is_decided_by_position",
    "test_left_padded_encoder_equals_itself_alone",
    "test_padded_prefix_continued_equals_each_row_alone",
    "test_left_padded_prompt_equals_each_row_alone",
    "test_image_prefill_in_a_padded_batch_continued_from_the_cache",
)
PROBE_ID = re.compile(rf"^({'|'.join(PROBE_TESTS)})\[(?P<type>.+?)(?:-(?P<attention>eager|sdpa)(?:-.*)?)?\]$")
OUTCOME_ORDER = {"skip": 0, "pass": 1, "fail": 2}  # the cell of several tests: any fail, else any pass


def read_probe(path: Path) -> dict:
    """{model type: {attention: {test: {"outcome", "message", "kind"?, "stock"?, "hfpatch"?}}}} from a
    probe JUnit XML: the tests of one model type and attention (one cell, :func:`fold`)."""
    result: dict = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        match = PROBE_ID.match(case.get("name", ""))
        if match is None:
            continue
        model_type, attention = match["type"], match["attention"] or "eager"
        entry = {"outcome": "pass", "message": ""}
        for child in case:
            if child.tag in ("failure", "error"):
                entry.update(outcome="fail", message=(child.get("message") or "")[:300])
                entry["kind"] = failure_kind(f"{child.get('message') or ''}\n{child.text or ''}")
            elif child.tag == "skipped" and entry["outcome"] != "fail":
                entry.update(outcome="skip", message=_clean(child.get("message", "")))
        entry.update((p.get("name"), float(p.get("value"))) for p in case.iter("property"))
        test = f"{case.get('classname')}::{case.get('name')}"
        result.setdefault(model_type, {}).setdefault(attention, {})[test] = entry
    return result


def fold(tests: dict) -> dict:
    """One cell from its tests, in order: the worst outcome (any fail, else any pass, else the first
    skip) with its message and kind; the largest differences."""
    cell: dict = {}
    for entry in tests.values():
        if not cell:
            cell = dict(entry)
            continue
        if OUTCOME_ORDER[entry["outcome"]] > OUTCOME_ORDER[cell["outcome"]]:
            cell.update(outcome=entry["outcome"], message=entry["message"])
            cell.pop("kind", None)
            cell.update({"kind": entry["kind"]} if "kind" in entry else {})
        for name in ("stock", "hfpatch"):
            if name in entry:
                cell[name] = max(entry[name], cell.get(name, entry[name]))
    return cell


def merge_probes(sources: list[Path]) -> dict:
    """{model type: {attention: cell}} from probe JUnit XMLs in order: a later source's result of a test
    replaces an earlier one's (a skip replaces nothing); each cell is then the :func:`fold` of its tests,
    so a partial re-run of some tests leaves the others' results standing."""
    tests: dict = {}
    for source in sources:
        for model_type, runs in read_probe(source).items():
            for attention, found in runs.items():
                merged = tests.setdefault(model_type, {}).setdefault(attention, {})
                for test, run in found.items():
                    if test not in merged or run["outcome"] != "skip":
                        merged[test] = run
    return {
        model_type: {attention: fold(found) for attention, found in runs.items()}
        for model_type, runs in tests.items()
    }


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
    summary: dict = {}
    for release in RELEASES:
        junit = HERE / "results" / f"{release}.xml"
        counts = HERE / "results" / f"{release}.cases.json"
        entry: dict = {"ran": junit.exists()}
        if junit.exists():  # with partial re-runs of some tests (RELEASE.TAG.xml) replacing their results
            merged = {(c[0], c[1]): c for c in read_junit(junit)}
            for rerun in sorted((HERE / "results").glob(f"{release}.*.xml")):
                merged.update({(c[0], c[1]): c for c in read_junit(rerun) if c[2] != "skip"})
            cases = list(merged.values())
            entry["tests"] = {o: sum(1 for c in cases if c[2] == o) for o in ("pass", "fail", "skip")}
            entry["cells"] = cells(cases)
        if counts.exists():
            entry["cases"] = json.loads(counts.read_text())
        folder = HERE / "results" / "probe"
        # the full suite, which runs the probe too inside the declared ranges, then the probe run (every
        # release and model type, --outside-ranges), then partial re-runs of it (RELEASE.TAG.xml)
        sources = [junit, folder / f"{release}.xml", *sorted(folder.glob(f"{release}.*.xml"))]
        probe = merge_probes([path for path in sources if path.exists()])
        if probe:
            entry["probe"] = probe
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
        "Generated by `python compat/report.py` from `compat/results/`, made by `bash compat/run_matrix.sh`",
        "(the full test suite on the flagship architectures: one virtualenv per release with torch 2.13.0",
        "CPU, the `matrix` hypothesis profile, no inductor test, one torch thread) and",
        "`bash compat/probe_matrix.sh` (`hfpatch.verify` on every covered model type). Do not edit by hand.",
        f"Code tested: full suite {_suite_commits()} (the *code* column), partial re-runs at "
        f"{_commit('results')}; probe at {_commit('results/probe')}.",
        "",
        headline,
        "",
        "Invariants: " + "; ".join(f"**{c}** {what}" for c, what, _ in INVARIANTS) + ".",
        "",
    ]
    header = ["release"] + [f"{arch} {c}" for arch in ARCHS for c, _, _ in INVARIANTS] + ["general", "code"]
    commits = _release_commits()
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
            row += [show(entry["cells"].get(arch, {}).get(c)) for c, _, _ in INVARIANTS]
        general = entry["cells"].get("any", {})
        row.append("**FAIL**" if any(s == "fail" for s, _ in general.values()) else "pass")
        row.append(f"`{commits[release]}`" if release in commits else "-")
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
                row += [_wrong(count, "stock"), _wrong(count, "hfpatch")]
            else:
                row += ["n/a", "n/a"]
        lines.append("| " + " | ".join(row) + " |")
    lines += _render_probe(summary)
    lines += ["", "## Notes: why a cell is n/a, known-bad or marked", ""]
    lines += [f"{i + 1}. {reason}" for i, reason in enumerate(footnotes)]
    return "\n".join(lines) + "\n"


def probe_verdicts(summary: dict) -> dict:
    """{model type: {release: "pass" | "fail" | "outside" | "absent"}} over the probed releases."""
    verdicts: dict = {}
    for release, entry in summary.items():
        for model_type, runs in entry.get("probe", {}).items():
            verdicts.setdefault(model_type, {})[release] = probe_verdict(runs)
    return verdicts


def _render_probe(summary: dict) -> list[str]:
    probed = [r for r, e in summary.items() if "probe" in e]
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
        "image where the test has one), each row against itself run alone. "
        "A cell comes from the probe run (every release and model type, in the declared range or not), "
        "or from the full suite's run where the probe has none. "
        "*ships*: the matrix releases that have it; *exact*: of those in the declared range, how many "
        f"pass (every real token within 1e-5 of its row run alone); stock and hfpatch: the largest "
        f"max|diff| over the scenarios on {newest}.",
    ]
    in_range_cells = [
        by_release.get(release, "not probed")
        for name, adapter in REGISTRY.items()
        for model_type in (name, *adapter.aliases)
        for release, by_release in [(r, verdicts.get(model_type, {})) for r in probed]
        if _patched_on(adapter, release, model_type) and by_release.get(release) != "absent"
    ]
    passed = sum(1 for verdict in in_range_cells if verdict == "pass")
    left = Counter(
        _cell_kind(summary[release]["probe"].get(name, {}))
        for name, adapter in REGISTRY.items()
        for release in probed
        if not _patched_on(adapter, release) and verdicts.get(name, {}).get(release) == "fail"
    )
    why = "; ".join(f"{n} {kind}" for kind, n in sorted(left.items())) or "none"
    lines += [
        "",
        f"**{passed} of {len(in_range_cells)} (model type, release) pairs in the declared ranges pass: "
        f"{passed} patched cells.** Where a class ships and is not patched (below its range, or a known-bad "
        f"release inside it), the probe says why: {why}. *wrong with the positions*: hfpatch patched it "
        "and it is still wrong (a limit of that release); *a scenario fails on stock too*: transformers "
        "raises there, with or without hfpatch (e.g. a cache the model makes itself, sized to the "
        "prompt); *right on stock there*: nothing to patch; *class differs*: that release's class is "
        "not the one hfpatch patches; *tiny model "
        "does not run*: nothing could be measured there. Every "
        "release where the probe passes is patched (`tests/test_compat_report.py` checks it).",
    ]
    families: dict = {}
    for name, adapter in REGISTRY.items():
        families.setdefault(adapter.family.name, []).append((name, adapter))
    for family, members in families.items():
        lines += [
            "",
            f"### Family `{family}` ({sum(1 + len(a.aliases) for _, a in members)} model types)",
            "",
        ]
        lines += [
            "| model type | class | declared | ships | exact | not patched, and why | stock | hfpatch |",
            "|---" * 8 + "|",
        ]
        for name, adapter in members:
            for model_type in (name, *adapter.aliases):
                by_release = verdicts.get(model_type, {})
                ships = [r for r, v in by_release.items() if v != "absent"]
                declared = [r for r in ships if _patched_on(adapter, r, model_type)]
                passed = [r for r in declared if by_release[r] == "pass"]
                failing = _not_patched(summary, adapter, model_type, by_release)
                newest_run = summary[newest].get("probe", {}).get(model_type, {})
                stock = max((run.get("stock", 0.0) for run in newest_run.values()), default=None)
                fixed = max((run.get("hfpatch", 0.0) for run in newest_run.values()), default=None)
                span = f"{ships[0]} - {ships[-1]} ({len(ships)})" if ships else "-"
                holes = "".join(f", not {spec.removeprefix('==')}" for spec, _ in adapter.known_bad)
                cells = [model_type, adapter.cls, adapter.versions + holes, span]
                cells += [f"{len(passed)}/{len(declared)}"]
                cells += [failing or "-", _num(stock), _num(fixed)]
                lines.append("| " + " | ".join(cells) + " |")
    return lines


def _cell_kind(runs: dict) -> str:
    """One failing cell's reason (eager and SDPA): wrong first, then class differs, then not buildable."""
    kinds = {run.get("kind") for run in runs.values() if run["outcome"] == "fail"}
    return next((kind for kind in FAILURE_KINDS if kind in kinds), NOT_BUILDABLE)


def _not_patched(summary: dict, adapter, model_type: str, by_release: dict) -> str:
    """Releases that ship the model type and where it is not patched, grouped by the probe's reason."""
    groups: dict = {}
    for release, verdict in by_release.items():
        if verdict == "fail" and not _patched_on(adapter, release, model_type):
            groups.setdefault(_cell_kind(summary[release]["probe"][model_type]), []).append(release)
    return "; ".join(
        f"{kind}: {rs[0]}" + (f" - {rs[-1]} ({len(rs)})" if len(rs) > 1 else "")
        for kind, rs in groups.items()
    )


def _patched_on(adapter, release: str, model_type: str = "") -> bool:
    """In the declared range and not declared known-bad there (what the range test calls tested); for an
    alias verified from a later release (``alias_since``), from there."""
    since = dict(adapter.alias_since).get(model_type)
    if since is not None and Version(release) < Version(since):
        return False
    return support(adapter, Version(release)).level == TESTED


def _release_commits() -> dict:
    """{release: commit} of the full-suite runs (compat/results/COMMITS, one "release commit" line per
    session that ``run_matrix.sh`` ran; the last line for a release wins)."""
    path = HERE / "results" / "COMMITS"
    lines = path.read_text().split("\n") if path.exists() else []
    return dict(line.split()[:2] for line in lines if len(line.split()) >= 2)


def _suite_commits() -> str:
    commits = _release_commits()
    runs = [f"at `{commit}` ({n} releases)" for commit, n in Counter(commits.values()).items()]
    earlier = ", the rest from earlier runs (commit not recorded)" if len(commits) < len(RELEASES) else ""
    return ", ".join(runs) + earlier if runs else "(commit not recorded)"


def _commit(folder: str) -> str:
    runs = [
        f"`{path.read_text().strip()}`" + (f" ({path.suffix[1:]})" if path.suffix else "")
        for path in sorted([*(HERE / folder).glob("COMMIT"), *(HERE / folder).glob("COMMIT.*")])
    ]
    return ", ".join(runs) or "(not recorded)"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"


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
