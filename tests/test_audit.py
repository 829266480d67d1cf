"""hfpatch audit: a run's results stay stock's, bit for bit, and its counts are what each row run alone
says (the truth is computed here, from stock logits and each row alone, without hfpatch's harness);
the rule it counts by (positions.stock_error) matches every token of random padded, cached calls."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from packaging.version import Version

import hfpatch
from hfpatch.positions import positions_from_mask, stock_error
from hfpatch.support import NEWEST_TESTED, in_range
from hfpatch.windows import positional

from conftest import REGISTRY, TF, arch_skip_reason, static_cache_skip_reason

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import audit_script  # noqa: E402

TOLERANCE = 1e-5
COUNTED = ("calls", "affected", "rows", "tokens")


def _need(*archs: str) -> None:
    for arch in archs:
        if arch_skip_reason(arch):
            pytest.skip(arch_skip_reason(arch))


def wrong_tokens(model, ids, mask, num_new, logits) -> torch.Tensor:
    """[batch, num_new] bool: the real new tokens whose logits differ from the row run alone."""
    wrong = torch.zeros(mask.shape[0], num_new, dtype=torch.bool)
    with torch.no_grad():
        for row in range(mask.shape[0]):
            real = mask[row] != 0
            new_real = real[-num_new:]
            count = int(new_real.sum())
            if count:
                alone = model(input_ids=ids[row][real][None]).logits[0, -count:]
                far = (logits[row][new_real] - alone).abs().amax(-1) > TOLERANCE
                wrong[row, new_real.nonzero().flatten()] = far
    return wrong


def wrong_packed_tokens(model, ids, positions, mask, logits) -> torch.Tensor:
    """[batch, length] bool: the real tokens of packed rows whose logits differ from their sequence run
    alone (a sequence starts where a real token's position is not the previous one's + 1)."""
    wrong = torch.zeros(mask.shape, dtype=torch.bool)
    with torch.no_grad():
        for row in range(mask.shape[0]):
            columns = mask[row].nonzero().flatten().tolist()
            starts = [
                i
                for n, i in enumerate(columns)
                if n == 0 or positions[row, i] != positions[row, columns[n - 1]] + 1
            ]
            for first, end in zip(starts, [*starts[1:], columns[-1] + 1]):
                alone = model(input_ids=ids[row, first:end][None]).logits[0]
                wrong[row, first:end] = (logits[row, first:end] - alone).abs().amax(-1) > TOLERANCE
    return wrong


def truth(records, models) -> dict:
    counts = {}
    for record in records:
        model = models[record["arch"]]
        if "positions" in record:
            wrong = wrong_packed_tokens(
                model, record["ids"], record["positions"], record["mask"], record["logits"]
            )
        else:
            wrong = wrong_tokens(model, record["ids"], record["mask"], record["new"], record["logits"])
        entry = counts.setdefault(record["arch"], dict.fromkeys(COUNTED, 0))
        rows = int(wrong.any(-1).sum())
        entry["calls"] += 1
        entry["affected"] += rows > 0
        entry["rows"] += rows
        entry["tokens"] += int(wrong.sum())
    return counts


@pytest.mark.slow  # two subprocesses that build models: nox -s ci runs it
def test_audit_leaves_results_stock_and_counts_what_each_row_alone_says(tmp_path):
    _need("gpt2", "llama", "mistral")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    script = str(HERE / "audit_script.py")
    subprocess.run(
        [sys.executable, script, str(tmp_path / "stock.pt")], env=env, check=True, capture_output=True
    )
    report = tmp_path / "audit.json"
    done = subprocess.run(
        [sys.executable, "-m", "hfpatch", "audit", "--json", str(report), "--", sys.executable,
         "tests/audit_script.py", str(tmp_path / "audited.pt")],
        env=env, capture_output=True, text=True, cwd=HERE.parent,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    stock, audited = torch.load(tmp_path / "stock.pt"), torch.load(tmp_path / "audited.pt")
    calls = sum(len(calls) for _, calls in audit_script.CHAINS) + len(audit_script.PACKED)
    calls += len(audit_script.GENERATE) * (1 + audit_script.STEPS)  # the prompt, then generate()'s calls
    assert len(stock) == len(audited) == calls
    for before, after in zip(stock, audited):
        assert torch.equal(before["logits"], after["logits"])  # the same bits
    counted = json.loads(report.read_text())
    expected = truth(stock, {arch: audit_script.build(arch) for arch in dict(audit_script.CHAINS)})
    for arch, entry in counted.items():  # stock wrong by a rule of the release's own: not judged
        if entry["not_judged"]:
            assert set(entry["not_judged"]) <= {
                "this release's SDPA mask of a padded cached prefix continued by several tokens",  # 4.36-4.37
                "a packed row with a window by this release's own rule",  # (Mistral's, before masking_utils)
                "a sliding window by this release's own rule",
            }, entry
            expected.pop(arch)
    assert {arch: {name: counted[arch][name] for name in COUNTED} for arch in expected} == expected
    assert expected, "no model type was judged"
    assert all(expected[arch]["affected"] for arch in expected)  # stock is wrong in each, somewhere
    packed = {arch: sum(1 for a, *_ in audit_script.PACKED if a == arch) for arch in expected}
    assert {arch: counted[arch]["packed"] for arch in expected} == packed
    for arch in expected:  # left padding in one call: right on stock where positions are rotary
        if REGISTRY[arch].family.name == "rotary":
            assert expected[arch]["affected"] < expected[arch]["calls"], arch
    calling = ("out = model(", "out = built[", "prompt = model(", "model.generate(")
    lines = [n for n, text in enumerate(script_lines(), 1) if any(call in text for call in calling)]
    sites = {f"tests/audit_script.py:{n}" for n in lines}  # the first frame outside transformers
    assert set().union(*(counted[arch]["sites"] for arch in counted)) == sites
    printed = done.stderr[done.stderr.index("hfpatch audit: what stock") :].strip()
    if TF == Version(NEWEST_TESTED):  # the README shows what it prints (on the newest tested release)
        assert f"```\n{printed}\n```" in (HERE.parent / "README.md").read_text(), printed


def script_lines() -> list[str]:
    return (HERE / "audit_script.py").read_text().splitlines()


def _random_chain(generator: torch.Generator, batch: int = 3) -> list[torch.Tensor]:
    """One to three calls' masks: pads anywhere, every row with a real token in its first call."""
    calls = []
    for _ in range(int(torch.randint(1, 4, (), generator=generator))):
        width = int(torch.randint(1, 6, (), generator=generator))
        calls.append((torch.rand(batch, width, generator=generator) > 0.35).long())
    calls[0][:, -1] = 1
    return calls


@pytest.mark.parametrize("given", [False, True], ids=["by column", "some calls by the mask"])
@pytest.mark.parametrize("arch", ["gpt2", "llama", "mistral"])
def test_the_rule_matches_every_token_of_random_padded_cached_calls(arch, given):
    """stock_error's verdict for each real token of each call equals the stock logits against the row
    alone: 12 random chains of cached calls (windows of 3 for Mistral); ``given``: a random half of the
    calls pass the mask's positions (as generate() does), the others none."""
    _need(arch)
    model = audit_script.build(arch)
    adapter = hfpatch.registry()[arch]
    window = getattr(model.config, "sliding_window", None)  # the script sets one where the config has it
    if window and not positional(model, adapter.cls):
        pytest.skip(f"{arch}'s window on transformers {TF} is its own (the audit does not judge it)")
    relative = adapter.family.name == "rotary"
    windows = [window] * model.config.num_hidden_layers if window else []
    # 4.36-4.37's SDPA mask of a padded cached prefix continued by several tokens is wrong whatever the
    # positions (Adapter.eager_mask): the audit does not judge those calls, and neither does this test
    own_mask = (
        adapter.eager_mask is not None
        and in_range(adapter.eager_mask[0], TF)
        and model.config._attn_implementation == "sdpa"
    )
    generator = torch.Generator().manual_seed(7)
    checked = wrong_seen = 0
    with hfpatch.unpatched(), torch.no_grad():
        for _ in range(12):
            cache, mask, ids, numbered = None, None, None, None
            # each row's tokens distinct (a repeated token attended at two distances reads one value: right by
            # coincidence where the rule says wrong)
            pool = torch.stack([torch.randperm(57, generator=generator) + 3 for _ in range(3)])
            for new in _random_chain(generator):
                taken = 0 if ids is None else ids.shape[1]
                tokens = pool[:, taken : taken + new.shape[1]]
                mask = new if mask is None else torch.cat([mask, new], 1)
                ids = tokens if ids is None else torch.cat([ids, tokens], 1)
                by_mask = given and bool(torch.rand((), generator=generator) < 0.5)
                positions = {"position_ids": positions_from_mask(mask)[:, -new.shape[1] :]} if by_mask else {}
                out = model(
                    input_ids=tokens, attention_mask=mask, past_key_values=cache, use_cache=True, **positions
                )
                cache = out.past_key_values
                column = torch.full((1, new.shape[1]), not by_mask)
                numbered = column if numbered is None else torch.cat([numbered, column], 1)
                truth_ = wrong_tokens(model, ids, mask, new.shape[1], out.logits)
                if own_mask and 1 < new.shape[1] < mask.shape[1] and bool((mask == 0).any()):
                    continue  # (not judged: see above)
                predicted = (
                    stock_error(mask, new.shape[1], relative, windows, numbered if given else None) > 0
                )
                assert torch.equal(predicted, truth_), (mask, predicted, truth_)
                checked += int((new != 0).sum())
                wrong_seen += int(truth_.sum())
    assert wrong_seen and wrong_seen < checked  # both verdicts occur


def test_in_process_audit_counts_patched_calls_and_says_what_it_cannot_judge():
    """``with hfpatch.audit()``: calls hfpatch's patch runs (apply() holds here) are counted as
    patched, the caller's positions as given, a static cache as not judged; a model type hfpatch does
    not patch is listed, not counted right; the results are the same bits as outside the audit."""
    _need("gpt2")
    from hfpatch._compat import new_static_cache
    from hfpatch.verification.tiny import tiny_model

    model = tiny_model("gpt2")
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    left = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    static = None
    if static_cache_skip_reason(model) is None:  # (it calls the model: before the audit)
        with contextlib.suppress(AttributeError, TypeError):  # no StaticCache for GPT-2 before 4.52
            static = new_static_cache(model, 2, 8)
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=left).logits
        with hfpatch.audit() as report:
            during = model(input_ids=ids, attention_mask=left).logits  # patched: apply() holds
            model(input_ids=ids, attention_mask=left, position_ids=torch.arange(4).expand(2, -1))
            if static is not None:
                model(input_ids=ids, attention_mask=torch.cat([left, torch.zeros(2, 4, dtype=left.dtype)], 1),
                      past_key_values=static, use_cache=True)  # fmt: skip
    assert torch.equal(before, during)
    counted = report.as_dict()["gpt2"]
    assert counted["calls"] == 2 + (static is not None) and counted["patched"] == counted["calls"]
    assert counted["affected"] == 1 and counted["positions_given"] == 1
    if static is not None:
        assert counted["not_judged"] == {"a static cache": 1}, counted
    text = str(report)
    assert text.startswith("hfpatch audit:") and "gpt2" in text


def test_a_model_that_takes_its_positions_from_the_mask():
    """OPT (right on stock with padding: positions from the mask's cumsum): a left-padded call is not
    counted wrong; a packed call is, at each token of a sequence after the row's first (the truth: each
    sequence alone)."""
    from hfpatch.verification.tiny import tiny_model

    if "opt" not in hfpatch.registry() or not hfpatch.status()["opt"].support == "tested":
        pytest.skip(f"OPT's packed rows are patched from 4.46 (installed {TF})")
    model = tiny_model("opt")
    left = {"input_ids": torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]]),
            "attention_mask": torch.tensor([[0, 0, 1, 1, 1], [1] * 5])}  # fmt: skip
    ids, positions = torch.tensor([[5, 6, 7, 8, 9, 10]]), torch.tensor([[0, 1, 2, 0, 1, 2]])
    with hfpatch.unpatched(), torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions).logits
        truth = wrong_packed_tokens(model, ids, positions, torch.ones_like(ids), packed)
    with hfpatch.audit() as report, torch.no_grad():
        model(**left)
        model(input_ids=ids, position_ids=positions)
    counted = report.as_dict()["opt"]
    assert counted["calls"] == 2 and counted["affected"] == 1 and counted["packed"] == 1, counted
    assert counted["tokens"] == int(truth.sum()) == 3, counted


def test_audit_lists_a_model_type_it_cannot_judge():
    """A model of a type hfpatch does not patch (MPT: ALiBi from cache columns) is listed with why."""
    _need("gpt2")
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "MptConfig"):
        pytest.skip("no MPT in this transformers release")
    config = transformers.MptConfig(vocab_size=64, d_model=16, n_heads=2, n_layers=2, expansion_ratio=2)
    mpt = transformers.MptForCausalLM(config).eval()
    with hfpatch.audit() as report:
        with torch.no_grad():
            mpt(input_ids=torch.tensor([[5, 6, 7]]))
    data = report.as_dict()
    assert data["mpt"]["calls"] is None and "hfpatch does not patch it" in next(
        iter(data["mpt"]["not_judged"])
    )
    assert "not judged: mpt" in str(report)


@pytest.mark.parametrize(
    ("args", "code", "says"),
    [
        ((), 2, "expected a command"),
        (("--json", "/no/such/folder/a.json", "--", sys.executable, "-c", "pass"), 2, "does not exist"),
        (("--", "no-such-command-hfpatch"), 127, "cannot run"),
    ],
)
def test_audit_command_mistakes_are_one_line(args, code, says):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("HFPATCH_")}
    done = subprocess.run([sys.executable, "-m", "hfpatch", "audit", *args], capture_output=True, text=True,
                          env=environ, timeout=300)  # fmt: skip
    assert done.returncode == code, done.stderr
    assert "Traceback" not in done.stderr and says in done.stderr.splitlines()[0], done.stderr


def test_audit_exits_with_the_commands_status_and_reports_no_calls(tmp_path):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("HFPATCH_")}
    report = tmp_path / "a.json"
    done = subprocess.run(
        [sys.executable, "-m", "hfpatch", "audit", "--json", str(report), "--", sys.executable, "-c",
         "raise SystemExit(3)"],
        capture_output=True, text=True, env=environ, timeout=300,
    )  # fmt: skip
    assert done.returncode == 3, done.stderr
    assert json.loads(report.read_text()) == {} and "no call of a model hfpatch patches" in done.stderr
