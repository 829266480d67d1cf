"""A new transformers release, the week it ships: what it changes for hfpatch (``nox -s newest`` runs it).

    python compat/newest.py release          # the registry's newest transformers release
    python compat/newest.py diff RELEASE [AGAINST]   # RELEASE's evidence against AGAINST's (default:
                                                     # the newest tested release's)

``nox -s newest`` installs the registry's newest release (or ``NEWEST=X.Y.Z``) with torch pinned, runs the
matrix on it with the whole suite (``compat/matrix.py run``: the probe ``--outside-ranges``, the suite,
the case count; compat/evidence/RELEASE.json), then prints this diff: the model types the release maps
that no tested release did (declare them), the ones it dropped, each probe verdict that differs from the
newest tested release's (a type newly wrong, or newly right on stock: its declaration to revisit), and the
suite's failures. From there to "tested" (docs/compatibility.md, "A new release"): add the release to
compat/releases.txt (the newest CI release follows), ``NEWEST_TESTED`` in hfpatch/support.py and the
quick start's pin, ``python compat/model_types.py WHEELS`` and the declarations of the new types, the
probe's verdicts answered (ranges, ``known_bad``), then ``python compat/report.py``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from hfpatch.support import NEWEST_TESTED  # noqa: E402

EVIDENCE = HERE / "evidence"


def newest_release() -> str:
    """The newest transformers release the package registry has (its wheel's name, downloaded)."""
    with tempfile.TemporaryDirectory() as folder:
        pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "transformers", "-d", folder]
        subprocess.run(pip, check=True)
        [wheel] = Path(folder).glob("transformers-*.whl")
    return re.match(r"transformers-([^-]+)-", wheel.name).group(1)  # type: ignore[union-attr]


def verdicts(evidence: dict) -> dict[tuple[str, str], str]:
    """``(probe test, case)``: the probe's verdict (its third field: exact, class differs ...)."""
    found = {}
    for test, cases in evidence.get("probe", {}).items():
        for case, row in cases.items():
            found[(test.split("::")[-1], case)] = row[2] if len(row) > 2 else str(row)
    return found


def diff(release: str, against: str = NEWEST_TESTED) -> list[str]:
    """What ``release``'s evidence says differently from ``against``'s, a line each."""
    new, old = (json.loads((EVIDENCE / f"{r}.json").read_text()) for r in (release, against))
    known = json.loads((HERE / "model_types.json").read_text())  # every tested release's, mapped
    here = mapped_types()
    lines = [f"new model type (declare it): {t}" for t in sorted(here - set(known))]
    lines += [
        f"no longer mapped: {t}" for t in sorted(t for t in known if known[t][1] == against and t not in here)
    ]
    before, after = verdicts(old), verdicts(new)
    for key in sorted(before.keys() | after.keys()):
        if before.get(key) != after.get(key):
            was, now = before.get(key, "absent"), after.get(key, "absent")
            lines.append(f"{key[0]} [{key[1]}]: {against} {was} -> {release} {now}")
    failed = [
        f"{test}[{case}]: failed"
        for test, cases in new.get("suite", {}).items()
        for case, row in cases.items()
        if row and row[0] == "fail"
    ]
    lines += failed
    lines.append(
        f"{release}: {len(here)} model types mapped, {len(after)} probe cases "
        f"({sum(v == 'exact' for v in after.values())} exact), {len(lines)} lines above"
    )
    return lines


def mapped_types() -> set[str]:
    """The model types of the installed release's mappings that ``hfpatch.status()`` answers for."""
    from transformers.models.auto import modeling_auto

    from hfpatch.support import MAPPINGS

    return {t for name in MAPPINGS for t in getattr(modeling_auto, name, {})}


if __name__ == "__main__":
    if sys.argv[1:] == ["release"]:
        print(newest_release())
    elif len(sys.argv) in (3, 4) and sys.argv[1] == "diff":
        print("\n".join(diff(*sys.argv[2:])))
    else:
        sys.exit(f"usage: python {sys.argv[0]} release | diff RELEASE [AGAINST]")
