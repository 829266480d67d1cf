"""The command line as users run it (a subprocess each): the doctor shows the bug on stock and the fix;
``verify`` exits 0 when exact, 1 when wrong, 2 with one line and no traceback when it cannot run;
``--version`` and ``--help``; the launcher's own errors."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import hfpatch
from compat.vocabulary import FLAGSHIPS
from hfpatch import cli
from hfpatch.cli import DOCTOR_MODELS
from hfpatch.verification.load import tiny_attention
from hfpatch.verification.tiny import tiny_model, tiny_multimodal, tiny_seq2seq
from hfpatch.windows import positional

from conftest import TF, arch_skip_reason
from expectations import ABSOLUTE
from harness import TOLERANCE, WRONG


def _run(*args, env=None):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("HFPATCH_")}
    return subprocess.run(
        [sys.executable, "-m", "hfpatch", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**environ, **(env or {})},
    )


def _one_line_error(result, code):
    assert result.returncode == code, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and len(lines[0]) < 300, result.stderr
    return lines[0]


@pytest.mark.slow  # the doctor is the quick start's first command: nox -s ci runs it here
def test_doctor_shows_bug_and_fix():
    """The doctor says what it knows, why stock is wrong for each kind of model, and shows both kinds:
    GPT-2 (absolute positions) wrong on stock with left padding in one call, Llama (rotary) right there
    but wrong with holes; hfpatch exact on every row."""
    result = _run()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "model types (decoder-only, encoder-decoder, vision-language)" in result.stdout
    assert "Absolute positions" in result.stdout and "Rotary positions" in result.stdout, result.stdout
    verdicts = {line.split(":")[0]: line for line in result.stdout.splitlines() if ": " in line}
    for arch in DOCTOR_MODELS:
        assert arch in verdicts, f"the doctor says nothing of {arch}:\n{result.stdout}"
        if arch_skip_reason(arch):
            assert verdicts[arch].startswith(f"{arch}: not checked"), verdicts[arch]
        else:
            assert verdicts[arch].startswith(f"{arch}: fixed by hfpatch"), result.stdout
    rows = {}
    for line in result.stdout.splitlines():
        if line.startswith(f"{ABSOLUTE}: ") or line.startswith("llama: "):
            current = line.split(":")[0]
        elif line.strip().startswith(("left padding, one call", "right-padded prefix + 1 token")):
            name = "left" if "left padding" in line else "holes"
            rows[current, name] = [float(x) for x in line.split()[-2:]]
    if not arch_skip_reason(ABSOLUTE) and not arch_skip_reason("llama"):
        assert rows[ABSOLUTE, "left"][0] > WRONG and rows["llama", "left"][0] <= TOLERANCE, rows
        assert rows["llama", "holes"][0] > WRONG, rows
        assert all(patched <= TOLERANCE for _, patched in rows.values()), rows


@pytest.mark.slow  # a subprocess that builds models: nox -s ci runs it
def test_verify_a_checkpoint_directory(tmp_path):
    """A checkpoint saved with save_pretrained: a tiny Mistral with a sliding window of 4 tokens, which
    the scenarios exceed (holes from a padded cached prefix inside the window): exact with hfpatch, exit
    0, and stock wrong past the window. No deprecation warning from hfpatch's own loading."""
    if arch_skip_reason("mistral"):
        pytest.skip(arch_skip_reason("mistral"))
    model = tiny_model("mistral")
    if positional(model, "MistralModel"):  # else the tiny model's window is widened past the scenarios
        assert model.config.sliding_window == 4
    model.save_pretrained(tmp_path / "mistral")
    result = _run("verify", str(tmp_path / "mistral"), "--no-static")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("mistral: fixed by hfpatch"), result.stdout
    assert "torch_dtype" not in result.stderr
    if "past the window" in result.stdout:  # a release whose own masks apply the window (4.42+)
        row = next(line for line in result.stdout.splitlines() if "past the window" in line)
        assert float(row.split()[-2]) > 1e-3 and float(row.split()[-1]) <= 1e-5, row


@pytest.mark.slow  # a subprocess that builds models: nox -s ci runs it
def test_verify_encoder_decoder_models(tmp_path):
    """An encoder-decoder checkpoint (a tiny BART saved with save_pretrained): fixed, exit 0, every
    decoder scenario and the left-padded encoder input; with LED (declared not fixable by positions,
    and it takes no decoder positions to pass by hand) the exit status is 1."""
    if arch_skip_reason("bart"):
        pytest.skip(arch_skip_reason("bart"))
    tiny_seq2seq("bart").save_pretrained(tmp_path / "bart")
    result = _run("verify", str(tmp_path / "bart"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("bart: fixed by hfpatch"), result.stdout
    assert "decoder: right-padded prefix + 1 token" in result.stdout
    assert "encoder: left padding, one call" in result.stdout
    result = _run("verify", "bart", "led")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "bart: fixed by hfpatch" in result.stdout and "led: wrong on stock" in result.stdout, result.stdout


@pytest.mark.slow  # a subprocess that builds models: nox -s ci runs it
def test_verify_vision_language_models(tmp_path):
    """``verify`` on image-text-to-text models: a model type (PaliGemma, built tiny with eager attention:
    its SDPA limit stays a note) and a checkpoint directory (a tiny Qwen2-VL, where it is patched): their
    text calls are fixed, exit 0."""
    if arch_skip_reason("paligemma"):
        pytest.skip(arch_skip_reason("paligemma"))
    targets = ["paligemma"]
    if not arch_skip_reason("qwen2_vl"):  # 5.2+
        tiny_multimodal("qwen2_vl").save_pretrained(tmp_path / "qwen2_vl")
        targets.append(str(tmp_path / "qwen2_vl"))
    result = _run("verify", *targets, "--no-static")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "paligemma: fixed by hfpatch" in result.stdout, result.stdout
    assert len(targets) == 1 or "qwen2_vl: fixed by hfpatch" in result.stdout, result.stdout
    noted = "note: built tiny with eager attention" in result.stdout  # (where its SDPA is declared wrong)
    assert noted == (tiny_attention("paligemma") == "eager"), result.stdout


def test_verify_a_base_model_compares_hidden_states():
    """A base model (no LM head) is verified on its hidden states."""
    arch = next((a for a in FLAGSHIPS if not arch_skip_reason(a)), None)
    if arch is None:
        pytest.skip(f"transformers {TF} has none of {FLAGSHIPS}")
    model = tiny_model(arch).base_model
    result = hfpatch.verify(model)
    assert result.patches and result.ok and result.stock_wrong, str(result)


@pytest.mark.slow  # a subprocess that builds models: nox -s ci runs it
def test_verify_a_model_type_hfpatch_does_not_patch_exits_1():
    """MPT (ALiBi from the distance between cache columns: declared not fixable by positions) is wrong
    on stock and by hand: exit 1, and no verdict says it is fixed."""
    import transformers

    try:
        transformers.AutoConfig.for_model("mpt")
    except ValueError:
        pytest.skip(f"mpt is not in transformers {TF}")
    result = _run("verify", "mpt", "--no-static")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "mpt: wrong on stock" in result.stdout and "not fixable by positions" in result.stdout
    assert "fixed" not in result.stdout.splitlines()[0]


@pytest.mark.parametrize(
    "target, says",
    [
        ("./my-checkpoint", "./my-checkpoint: no such checkpoint directory"),
        pytest.param("gtp2", "did you mean gpt2", marks=pytest.mark.slow),
        pytest.param(
            "notamodel", "notamodel: not a checkpoint directory, nor a model type", marks=pytest.mark.slow
        ),
        pytest.param("electra", "electra: not a causal LM", marks=pytest.mark.slow),
        pytest.param(
            "prophetnet", "prophetnet: cannot build a tiny encoder-decoder model", marks=pytest.mark.slow
        ),
    ],
)
def test_verify_what_cannot_run_exits_2_with_one_line(target, says):
    line = _one_line_error(_run("verify", target), 2)
    assert line.startswith("python -m hfpatch verify: ") and says in line, line


@pytest.mark.slow  # a subprocess that builds models: nox -s ci runs it
def test_verify_carries_on_after_a_target_that_cannot_run():
    result = _run("verify", "./nowhere", "gpt2", "--no-static")
    assert result.returncode == 2 and "gpt2: fixed by hfpatch" in result.stdout, result.stdout + result.stderr


def test_version_help_and_usage_errors():
    version = _run("--version")
    assert version.returncode == 0 and version.stdout.strip() == f"hfpatch {hfpatch.__version__}"
    usage = _run("--help")
    assert usage.returncode == 0 and usage.stdout.startswith("usage: python -m hfpatch")
    assert "exit status:" in usage.stdout and "examples:" in usage.stdout and "``" not in usage.stdout
    assert _one_line_error(_run("verify"), 2).startswith("python -m hfpatch verify: ")
    assert _one_line_error(_run("no-such-command"), 2).startswith("python -m hfpatch: ")


def test_launcher_errors_name_the_variable():
    line = _one_line_error(_run("run", "--", sys.executable, "-c", "pass", env={"HFPATCH_ARCHS": "qwen"}), 2)
    assert "HFPATCH_ARCHS=qwen" in line and "did you mean" in line and "qwen2" in line, line
    line = _one_line_error(_run("run"), 2)
    assert "expected a command" in line
    line = _one_line_error(_run("run", "--", "no-such-command-anywhere"), 127)
    assert "cannot run 'no-such-command-anywhere'" in line
    code = "import hfpatch; print(hfpatch.status().applied_by)"
    result = _run("run", "--", sys.executable, "-c", code, env={"HFPATCH_ARCH": "llama"})
    assert result.returncode == 0 and "launcher" in result.stdout, result.stdout + result.stderr
    assert (
        "HFPATCH_ARCH is not a variable hfpatch reads: ignored (did you mean HFPATCH_ARCHS?)" in result.stderr
    )


def test_launcher_finds_its_own_python_without_an_activated_environment():
    """``.venv/bin/hfpatch run -- python script.py`` with the environment not activated: ``python`` is the
    one that has hfpatch (the launcher puts its environment first on PATH, as activating it would)."""
    if sys.prefix == sys.base_prefix:
        pytest.skip("not running in a virtual environment")
    code = "import hfpatch; print(hfpatch.status().applied_by)"
    here = os.path.dirname(sys.executable)
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if p != here)
    result = _run("run", "--", "python", "-c", code, env={"PATH": path})
    assert result.returncode == 0 and "launcher" in result.stdout, result.stdout + result.stderr


def test_launcher_names_hfpatch_in_rays_runtime_env_hook():
    """Ray calls ``RAY_RUNTIME_ENV_HOOK`` on every ``ray.init()``'s runtime_env: ``hfpatch run`` names
    hfpatch's (workers of clusters started elsewhere apply it); a hook of the user's own is kept, said
    in one line."""
    code = "import os; print(os.environ['RAY_RUNTIME_ENV_HOOK'])"
    result = _run("run", "--", sys.executable, "-c", code)
    assert result.returncode == 0 and result.stdout.split() == ["hfpatch.workers.ray_runtime_env"], result
    result = _run("run", "--", sys.executable, "-c", code, env={"RAY_RUNTIME_ENV_HOOK": "their.hook"})
    assert result.returncode == 0 and result.stdout.split() == ["their.hook"], result
    assert "RAY_RUNTIME_ENV_HOOK=their.hook is kept" in result.stderr and len(result.stderr.splitlines()) == 1


@pytest.mark.slow  # a subprocess that imports every model type: nox -s ci runs it
def test_status_lists_every_type_in_100_columns_and_named_ones_in_full():
    everything = _run("status")
    assert everything.returncode == 0, everything.stderr
    lines = everything.stdout.splitlines()
    assert max(len(line) for line in lines) <= 100
    rows = {line.split()[0] for line in lines if line and not line.startswith(" ")}
    known = hfpatch.status()
    ours = {arch for arch, entry in known.items() if entry.support != "custom"}  # (no class a test made)
    assert ours <= rows, sorted(ours - rows)[:5]
    named = _run("status", "gpt2", "llama")
    assert named.returncode == 0, named.stderr
    assert max(len(line) for line in named.stdout.splitlines()) <= 100
    for arch in ("gpt2", "llama"):
        if known[arch].support in ("tested", "untested newer"):  # patched once its module is imported
            assert f"{arch}: applied" in named.stdout, named.stdout
        assert known[arch].target in named.stdout
    line = _one_line_error(_run("status", "lama"), 2)
    assert line.startswith("python -m hfpatch status: ") and "did you mean llama" in line, line


def _verification(rows, patches=True, not_checked=()):
    from hfpatch.verification.result import Row, Verification

    return Verification("x", "applied", tuple(Row(*row) for row in rows), (), patches, True, not_checked)


NAN = float("nan")


@pytest.mark.parametrize(
    "rows, patches, not_checked, exit_code, says",
    [
        ([("a", 0.5, 0.0), ("b", 0.0, 0.0)], True, (), 0, "fixed by hfpatch"),
        ([("a", 0.5, 0.5)], True, (), 1, "WRONG with hfpatch"),
        ([("a", 0.0, NAN, "E")], True, (), 1, "WRONG with hfpatch"),  # hfpatch raises, stock runs
        ([("a", NAN, 0.0, "E")], True, (), 0, "fixed by hfpatch"),  # stock raises, hfpatch runs
        ([("a", NAN, NAN, "E"), ("b", 0.5, 0.0)], True, (), 2, "where checked; not checked: a"),
        ([("a", 0.0, 0.0)], False, ("its KV-cached calls",), 2, "not checked: its KV-cached calls"),
        ([("a", 0.0, 0.0)], False, (), 0, "right on stock (hfpatch does not patch it)"),
        ([("a", 1.2, 1.2)], False, ("its KV-cached calls",), 1, "wrong on stock"),
    ],
)
def test_verify_exits_0_only_for_what_it_checked(rows, patches, not_checked, exit_code, says):
    """A scenario that raised on both sides, or calls no scenario could make (a model that returns no KV
    cache: Mamba on 4.57), are not checked: nothing wrong found is exit 2 then, not 0."""
    result = _verification(rows, patches, not_checked)
    assert cli.exit_status(result) == exit_code
    assert says in result.verdict, result.verdict
