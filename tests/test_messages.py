"""What a user reads when they get something wrong or ask what happened: one short line naming the
argument and what was expected, no traceback from the CLI, no wall of text."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings

import pytest
from packaging.version import Version

import hfpatch
from hfpatch import _context, engine

from conftest import TF


def test_archs_that_are_not_model_types_name_the_argument():
    with pytest.raises(TypeError, match=r"^archs: expected a model type, a list of them, or None; got int$"):
        hfpatch.apply(123)
    with pytest.raises(ValueError, match=r"^archs: an empty list names no model type"):
        hfpatch.apply([])
    with pytest.raises(ValueError, match=r"unknown model type 'GPT2' \(did you mean gpt2"):
        hfpatch.apply("GPT2")
    with pytest.raises(TypeError, match="archs"):
        hfpatch.revert({"gpt2": True})


def test_status_of_an_unknown_type_is_one_short_line():
    with pytest.raises(KeyError) as caught:
        hfpatch.status()["lama"]
    message = str(caught.value)
    assert "'lama'" in message and "did you mean" in message and "llama" in message, message
    assert len(message) < 200 and "\n" not in message, message


def test_a_newer_release_warns_in_one_short_line(monkeypatch):
    hfpatch.revert()
    monkeypatch.setattr(engine, "installed_transformers", lambda: Version("9.1.0"))
    monkeypatch.setattr(_context, "WARNED", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hfpatch.apply()
    (warning,) = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    text = str(warning.message)
    assert "\n" not in text and len(text) < 200, text
    assert "9.1.0" in text and "hfpatch.status()" in text, text


def test_applied_by_names_the_programs_own_apply():
    hfpatch.revert()
    assert hfpatch.status().applied_by == ""
    hfpatch.apply("gpt2")
    assert hfpatch.status().applied_by == "hfpatch.apply() in this program"


def test_verify_of_a_model_hfpatch_leaves_alone_prints_no_nan(capsys):
    """MPT (ALiBi from cache columns: not fixable by positions): its rows print numbers, shortly."""
    import transformers

    try:
        transformers.AutoConfig.for_model("mpt")
    except ValueError:
        pytest.skip(f"mpt is not in transformers {TF}")
    text = str(hfpatch.verify("mpt"))
    assert "nan" not in text, text
    assert all(len(line) < 240 for line in text.splitlines()), text
    assert "not fixable by positions" in text


def _cli(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300
    )


def test_verify_of_a_missing_directory_answers_before_loading_torch():
    done = _cli(
        """
        import sys
        from hfpatch import cli
        code = cli.main(["verify", "./no-such-checkpoint"])
        print(code, "torch" in sys.modules)
        """
    )
    assert done.stdout.split() == ["2", "False"], done.stdout + done.stderr
    assert done.stderr.strip() == "hfpatch verify: ./no-such-checkpoint: no such checkpoint directory"


@pytest.mark.slow  # imports transformers: nox -s ci runs it
def test_verify_suggests_model_types_not_class_names():
    """transformers' config mapping has a class-like key (EvollaModel on 5.24): not a model type."""
    from hfpatch.verification import CannotVerify

    with pytest.raises(CannotVerify) as caught:
        hfpatch.verify("notamodel")
    message = str(caught.value)
    suggested = (
        message.partition("did you mean ")[2].rstrip("?").split(" or ") if "did you mean" in message else []
    )
    assert all(name and name == name.lower() for name in suggested), message
