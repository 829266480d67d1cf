"""hfpatch benchmarks: what the patch costs, measured side by side in one run.

    python benchmarks/bench.py            # writes benchmarks/RESULTS.md and prints it

Every comparison interleaves its variants call by call (A, B, A, B, ...) and reports the median of
the per-repeat ratios, so drift on a noisy machine hits both sides alike. No result here is a test:
timings on shared CPUs are noisy, and the tests assert numbers, never times.
"""

from __future__ import annotations

import argparse
import platform
from pathlib import Path

import torch

import hfpatch

import decode
import depth
import imports
import packed
import scale
import scoring
import watchers
from harness import ROOT, Sections

# each file: one question, its SECTIONS
QUESTIONS = (decode, depth, scoring, packed, scale, watchers, imports)
ORDER = (  # the sections of RESULTS.md, in the order they stand there
    "## Eager forward on a padded batch: derived positions vs positions passed by hand",
    "## hfpatch's own Python work on an eager decode step, by profile",
    "## What a call costs against the model's depth: host reads and a decode step's Python frames",
    "## Scoring many padded rows: batched with hfpatch vs one row at a time on stock",
    "## Eager decode step: derived positions vs positions passed by hand",
    "## Encoder-decoder decode step: hfpatch vs stock",
    "## StaticCache decode step on 4.38-5.3: hfpatch's slot count vs explicit inputs, short and long caches",
    "## Decode step past a sliding window: windows by position vs transformers' own",
    "## Decode step with positions passed (as `generate()` makes it), a window, no holes",
    "## Packed training step: each sequence kept to itself vs stock's leak, and vs a padded batch",
    "## A padded batch at the cost of its real tokens: `apply(unpad=True)`",
    "## A packed row at length: time and memory against the sequences' own run",
    "## A compiled packed row: time and memory against the sequences' own compiled run",
    "## Decode step with positions passed, no window: the look for packed rows",
    "## Compiled decode step: hfpatch (mask only) vs stock with explicit inputs",
    "## Watching calls: `hfpatch audit` and `hfpatch.shadow`",
    "## `import hfpatch; hfpatch.apply()`",
    "## Scoring completions after a shared prompt (the original use case)",
)


def sections() -> Sections:
    """Each section of RESULTS.md: its heading and text, and what measures its rows."""
    found = [section for question in QUESTIONS for section in question.SECTIONS.items()]
    if sorted(heading for heading, _ in found) != sorted(ORDER):
        raise RuntimeError("ORDER and the question files' SECTIONS do not name the same headings")
    return dict(sorted(found, key=lambda section: ORDER.index(section[0])))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "RESULTS.md"))
    parser.add_argument("--only", nargs="*", default=None, metavar="WORD",
                        help="run only the sections whose heading has one of these words (lower case)")  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(1)  # one thread: steadier timings on a 2-core machine
    hfpatch.apply()
    import transformers

    setup = (
        f"{platform.machine()}, Python {platform.python_version()}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, one torch thread unless said below"
    )
    old = _sections_of(Path(args.out).read_text()) if Path(args.out).exists() else {}
    lines = [
        "# hfpatch benchmark results",
        "",
        "Made by `python benchmarks/bench.py` (the method: docs/cost.md). Each section says the setup it",
        "ran on; its ratios are interleaved in one run and compare like with like.",
    ]
    made = sections()
    for heading in _in_place(list(made), list(old)):
        if heading not in made:  # a section another script writes (benchmarks/hybrids.py): kept as it is
            lines += ["", heading, *old[heading]]
            continue
        text, measure = made[heading]
        wanted = args.only is None or any(word in heading.lower() for word in args.only)
        rows = measure() if wanted else []
        if rows:
            lines += ["", heading, "", f"Measured on {setup}.", *text, *rows]
        elif heading in old:  # not run now (or not applicable to this release): the last results stay
            lines += ["", heading, *old[heading]]
        else:
            lines += ["", heading, "", "Not measured yet.", *text]
    out = "\n".join(lines) + "\n"
    Path(args.out).write_text(out)
    print(out)


def _in_place(ours: list[str], old: list[str]) -> list[str]:
    """Our headings in their order, each heading of the earlier file that is not ours after the one it
    followed there (at the top where it led)."""
    order = list(ours)
    for i, heading in enumerate(old):
        if heading not in order:
            before = next((h for h in reversed(old[:i]) if h in order), None)
            order.insert(order.index(before) + 1 if before is not None else 0, heading)
    return order


def _sections_of(text: str) -> dict[str, list[str]]:
    """The sections of an earlier RESULTS.md, by heading (their lines after it)."""
    found: dict[str, list[str]] = {}
    heading = None
    for line in text.splitlines():
        if line.startswith("## "):
            heading = line
            found[heading] = []
        elif heading is not None:
            found[heading].append(line)
    return {heading: body[:-1] if body and not body[-1] else body for heading, body in found.items()}


if __name__ == "__main__":
    main()
