"""Counts per family and run, and every test id whose outcome differs between runs (a/b, b/c).

    python compare.py RESULTS_DIR [--json OUT]

Reads RESULTS_DIR/<family>.<a|b|c>.xml (junit) and <family>.c.record.jsonl (hfpatch_recorder).
"""

from __future__ import annotations

import json
import os
import sys
import xml.etree.ElementTree as ET

RUNS = ("a", "b", "c")


def outcomes(path: str) -> dict[str, tuple[str, str]]:
    out: dict[str, tuple[str, str]] = {}
    if not os.path.exists(path):
        return out
    for case in ET.parse(path).getroot().iter("testcase"):
        tid = f"{case.get('classname')}::{case.get('name')}"
        kind, msg = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                kind = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                msg = (child.get("message") or "").strip()
                break
        if kind == "error" and tid in out:  # a teardown error after a result: keep both
            kind = f"{out[tid][0]}+error"
        out[tid] = (kind, msg)
    return out


def records(path: str) -> dict[str, dict]:
    out: dict[str, dict] = {}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                r = json.loads(line)
                if "id" in r:
                    parts = r["id"].split("::")
                    key = ".".join([parts[0][:-3].replace("/", "."), *parts[1:-1]]) + "::" + parts[-1]
                    out[key] = r
    return out


def main() -> None:
    res = sys.argv[1]
    ids_only = "--ids" in sys.argv[2:]
    fams = sorted({f.split(".")[0] for f in os.listdir(res) if f.endswith(".xml")})
    table, diffs = [], []
    for fam in fams:
        runs = {r: outcomes(os.path.join(res, f"{fam}.{r}.xml")) for r in RUNS}
        rec = records(os.path.join(res, f"{fam}.c.record.jsonl"))
        counts = {}
        for r in RUNS:
            c: dict[str, int] = {}
            for kind, _ in runs[r].values():
                c[kind] = c.get(kind, 0) + 1
            counts[r] = c
        unpadded_tests = sum(1 for v in rec.values() if v.get("unpadded_calls"))
        table.append((fam, counts, unpadded_tests))
        for x, y in (("a", "b"), ("b", "c")):
            if not runs[x] or not runs[y]:
                continue
            broken = [
                r
                for r in (x, y)
                if any(k == "error" and "::" in t and t.startswith("::") for t, (k, _) in runs[r].items())
            ]
            if broken:  # a file that did not collect in one run: one line, not every absent id
                diffs.append(
                    (fam, f"{x}->{y}", f"collection failed in run(s) {broken}", ("", ""), ("", ""), None)
                )
                continue
            for tid in sorted(set(runs[x]) | set(runs[y])):
                ox, oy = runs[x].get(tid, ("absent", "")), runs[y].get(tid, ("absent", ""))
                if ox[0] != oy[0]:
                    rc = rec.get(tid)
                    diffs.append((fam, f"{x}->{y}", tid, ox, oy, rc))
    if ids_only:  # pytest node ids of the tests whose outcome differs (for rerun)
        for _fam, _pair, tid, _ox, _oy, _ in diffs:
            if "::" in tid:
                cls, name = tid.split("::")
                mod, klass = cls.rsplit(".", 1)
                print(f"{mod.replace('.', '/')}.py::{klass}::{name}")
        return
    print("| family | run | passed | failed | error | skipped | tests with unpadded calls (c) |")
    print("|---|---|---|---|---|---|---|")
    for fam, counts, unp in table:
        for r in RUNS:
            c = counts[r]
            if not c:
                continue
            print(
                f"| {fam} | {r} | {c.get('passed', 0)} | {c.get('failed', 0)} | {c.get('error', 0)} | "
                f"{c.get('skipped', 0)} | {unp if r == 'c' else ''} |"
            )
    print()
    for fam, pair, tid, ox, oy, rc in diffs:
        extra = f" (c: {rc['unpadded_calls']} unpadded calls, padded: {rc['padded']})" if rc else ""
        print(f"- [{fam} {pair}] {tid}" + (f": {ox[0]} -> {oy[0]}{extra}" if ox[0] else ""))
        for kind, msg in (ox, oy):
            if msg:
                print(f"    {kind}: {msg[:400]!r}")


if __name__ == "__main__":
    main()
