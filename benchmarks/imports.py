"""What ``import hfpatch; hfpatch.apply()`` costs in a fresh interpreter, alone and after what it uses."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys

from harness import Sections


def import_cost() -> list[str]:
    """`import hfpatch; hfpatch.apply()` in a fresh interpreter: alone, after torch + transformers, and
    after wrapt too (what hfpatch's own modules cost). Bytecode is written and used, as for an
    installed package (pip compiles it): a first run per setting writes it, then 7 are timed."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    rows = []
    for label, setup in (
        ("fresh interpreter", ""),
        ("torch and transformers already imported", "import torch, transformers;"),
        (
            "torch, transformers and wrapt already imported (hfpatch's own)",
            "import torch, transformers, wrapt;",
        ),
    ):
        code = (
            f"{setup}import sys, time; before = set(sys.modules); t = time.perf_counter(); "
            "import hfpatch; hfpatch.apply(); print((time.perf_counter() - t) * 1e3); "
            "new = set(sys.modules) - before; "
            "print(sum(m.startswith('transformers.models.') for m in new)); "
            "print(', '.join(sorted({m.split('.')[0] for m in new} - set(sys.stdlib_module_names))))"
        )
        command = [sys.executable, "-c", code]
        runs = [
            subprocess.run(command, capture_output=True, text=True, check=True, env=env).stdout.splitlines()
            for _ in range(8)
        ][1:]
        ms = statistics.median(float(r[0]) for r in runs)
        rows.append(f"| {label} | {ms:.1f} | {runs[0][1]} | {runs[0][2]} |")
    return rows


SECTIONS: Sections = {
    "## `import hfpatch; hfpatch.apply()`": (
        [
            "Median of 7 fresh interpreters (with bytecode, as installed). `apply()` imports wrapt only",
            "to wait for a module not imported yet (its post-import hook), as here; the last row is",
            "hfpatch's own cost.",
            "",
            "| setting | time (ms) | transformers.models modules imported | packages imported (not stdlib) |",
            "|---|---|---|---|",
        ],
        import_cost,
    ),
}
