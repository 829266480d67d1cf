"""`python -m hfpatch`, the README's main command: it shows the bug on stock and the fix; and
`python -m hfpatch verify`, which exits 1 when a patched model is not exact."""

from __future__ import annotations

import subprocess
import sys

import torch
from conftest import FLAGSHIPS, arch_skip_reason


def _run(*args):
    return subprocess.run(
        [sys.executable, "-m", "hfpatch", *args], capture_output=True, text=True, timeout=600
    )


def test_doctor_shows_bug_and_fix():
    result = _run()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "decoder-only model types known" in result.stdout
    for arch in FLAGSHIPS:
        line = next((line for line in result.stdout.splitlines() if line.startswith(f"{arch}: ")), "")
        if arch_skip_reason(arch):
            assert "fixed" not in line
            continue
        assert line.startswith(f"{arch}: fixed by hfpatch"), result.stdout


def test_verify_cli_on_a_checkpoint_directory(tmp_path):
    """A checkpoint saved with save_pretrained: exit 0 when exact; exit 1 when hfpatch patches the model
    but cannot make it exact (Mistral with a sliding window of 2 tokens: a hole from a padded cached
    prefix inside the window, the limit the README states)."""
    import pytest

    from hfpatch import probe

    if arch_skip_reason("mistral"):
        pytest.skip(arch_skip_reason("mistral"))
    # whether this release's default attention applies the window at all (4.39's SDPA path does not):
    # one unpadded sequence, windowed vs not; where it is not applied, verify must find it exact
    ids = torch.arange(1, 7)[None]
    outputs = []
    for window in (None, 2):
        model = probe.tiny_model("mistral")
        model.config.sliding_window = window
        rebuilt = type(model)(model.config).eval()
        rebuilt.load_state_dict(model.state_dict())
        with torch.no_grad():
            outputs.append(rebuilt(ids).logits)
    window_applies = not torch.allclose(outputs[0], outputs[1], atol=1e-5)
    for window, expected in ((None, 0), (2, int(window_applies))):
        model = probe.tiny_model("mistral")
        model.config.sliding_window = window
        rebuilt = type(model)(model.config)
        rebuilt.load_state_dict(model.state_dict())
        rebuilt.save_pretrained(tmp_path / str(window))
        result = _run("verify", str(tmp_path / str(window)), "--no-static")
        assert result.returncode == expected, result.stdout + result.stderr
        assert ("WRONG with hfpatch" in result.stdout) == bool(expected), result.stdout
    assert "sliding window" in result.stdout


def test_verify_cli_reports_a_model_type_it_does_not_patch():
    result = _run("verify", "mamba", "--no-static")
    if "mamba" not in result.stdout:
        import pytest

        pytest.skip("mamba is not in this transformers release")
    assert result.returncode == 0, "a model hfpatch does not patch is reported, not failed"
    assert "not fixable by positions" in result.stdout
