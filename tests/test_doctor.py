"""`python -m hfpatch`, the README's main command: it shows the bug on stock and the fix."""

from __future__ import annotations

import subprocess
import sys

from conftest import ARCHS, arch_skip_reason


def test_doctor_shows_bug_and_fix():
    result = subprocess.run([sys.executable, "-m", "hfpatch"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line.split() for line in result.stdout.splitlines()]
    for arch in ARCHS:
        verdicts = [row[-1] for row in rows if row and row[0] == arch and row[-1] in ("fixed", "ok", "FAIL")]
        if arch_skip_reason(arch):
            assert not verdicts
            continue
        assert len(verdicts) == 3 and "fixed" in verdicts and "FAIL" not in verdicts, result.stdout
