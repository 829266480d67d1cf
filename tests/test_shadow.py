"""hfpatch.shadow: live calls checked against their rows run alone. No mismatch on patched GPT-2 and
Llama, whose logits stay the same bits; a mismatch, warned once per call site, on a patched Llama whose
rotary embedding reads only row 0's positions and on stock GPT-2 with left padding; rate 0 checks
nothing; followed caches are let go when changed outside the calls; the program's RNG is untouched."""

from __future__ import annotations

import copy
import os
import random
import subprocess
import sys
import warnings

import pytest
import torch

import hfpatch
from hfpatch.verification.tiny import tiny_model

from conftest import arch_skip_reason, cache_object_skip_reason, make_dynamic_cache, spying
from harness import rotary_reading_row_zero

LEFT = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
RIGHT = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])


@pytest.fixture(params=["gpt2", "llama"])
def model(request):
    if arch_skip_reason(request.param):
        pytest.skip(arch_skip_reason(request.param))
    return tiny_model(request.param)


def followed(model) -> bool:
    """Whether the model returns a Cache object when given one (the shadow follows those; a legacy tuple
    is let go): Llama from 4.41, GPT-2 from 4.52."""
    if cache_object_skip_reason(model, "dynamic") is not None:
        return False
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor([[5, 6]]), past_key_values=make_dynamic_cache(model), use_cache=True
        )
    return not isinstance(out.past_key_values, (tuple, list))


def calls(model, ids):
    """A user's calls: left padding in one call, a right-padded prefix continued by 2 tokens and by 1
    (in a Cache object where the model takes one)."""
    out = [model(input_ids=ids, attention_mask=LEFT).logits]
    cache = {"past_key_values": make_dynamic_cache(model)} if followed(model) else {}
    first = model(input_ids=ids, attention_mask=RIGHT, use_cache=True, **cache)
    cache = first.past_key_values
    mask = torch.cat([RIGHT, torch.ones(2, 2, dtype=RIGHT.dtype)], 1)
    second = model(input_ids=ids[:, :2], attention_mask=mask, past_key_values=cache, use_cache=True)
    mask = torch.cat([mask, torch.ones(2, 1, dtype=RIGHT.dtype)], 1)
    third = model(input_ids=ids[:, :1], attention_mask=mask, past_key_values=second.past_key_values)
    return [*out, first.logits, second.logits, third.logits]


def test_no_mismatch_on_patched_models_and_the_same_bits(model):
    ids = torch.randint(5, 60, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = calls(model, ids)
        with warnings.catch_warnings():
            warnings.simplefilter("error", hfpatch.ShadowMismatch)
            with hfpatch.shadow(rate=1.0) as report:
                shadowed = calls(model, ids)
    assert all(torch.equal(a, b) for a, b in zip(plain, shadowed))
    assert report.checked == (8 if followed(model) else 4) and report.mismatches == 0, report  # every row
    assert report.worst <= 1e-5


def test_finds_a_rotary_kernel_that_reads_row_zeros_positions():
    """Liger-Kernel #461's bug in a patched Llama: hfpatch's positions are right, the kernel drops them;
    the shadow sees it, warns once at the call site, and counts the rest."""
    if arch_skip_reason("llama"):
        pytest.skip(arch_skip_reason("llama"))
    model = tiny_model("llama")
    if not followed(model):
        pytest.skip("the model returns no Cache object here: the shadow checks its uncached calls only")
    ids = torch.randint(5, 60, (2, 5), generator=torch.Generator().manual_seed(0))
    holes = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    with rotary_reading_row_zero(model), torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with hfpatch.shadow(rate=1.0) as report:
            for _ in range(4):
                first = model(input_ids=ids, attention_mask=holes, past_key_values=make_dynamic_cache(model))
                mask = torch.cat([holes, torch.ones(2, 2, dtype=holes.dtype)], 1)
                model(input_ids=ids[:, :2], attention_mask=mask, past_key_values=first.past_key_values)
    mismatches = [w for w in caught if issubclass(w.category, hfpatch.ShadowMismatch)]
    assert report.mismatches >= 1 and report.worst > 0.1, report
    assert len(mismatches) == 1, [str(w.message) for w in mismatches]  # once per model type and site
    message = str(mismatches[0].message)
    assert "LlamaModel (llama)" in message and "a cached prefix of 5 columns + 2 tokens" in message
    assert mismatches[0].filename == __file__  # reported at the caller's line
    assert hfpatch.status().shadow["mismatches"] >= report.mismatches


def test_finds_stock_gpt2_wrong_with_left_padding():
    if arch_skip_reason("gpt2"):
        pytest.skip(arch_skip_reason("gpt2"))
    model = tiny_model("gpt2")
    ids = torch.randint(5, 60, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), hfpatch.unpatched(), pytest.warns(hfpatch.ShadowMismatch, match="one padded call"):
        with hfpatch.shadow(rate=1.0, seed=1) as report:
            for _ in range(4):
                model(input_ids=ids, attention_mask=LEFT)
    assert report.checked == 8 and report.mismatches == 4  # every row at rate 1; row 1 (no pads) is right


def test_rate_zero_checks_nothing_and_the_programs_random_state_is_untouched(model):
    ids = torch.randint(5, 60, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with hfpatch.shadow(rate=0.0) as report:
            calls(model, ids)
        assert report.checked == 0 and report.skipped == {}
        torch_state, python_state = torch.random.get_rng_state(), random.getstate()
        with hfpatch.shadow(rate=1.0) as report:
            calls(model, ids)
        assert report.checked == (8 if followed(model) else 4)
    assert torch.equal(torch.random.get_rng_state(), torch_state) and random.getstate() == python_state


def test_a_copied_cache_is_followed_and_a_reordered_one_let_go(model):
    """Prompt reuse (a deep copy continued: the same keys, matched) is followed and checked; a cache
    reordered in place is let go: no check against a history the cache no longer has, so no false
    mismatch."""
    if not followed(model):
        pytest.skip("the model returns no Cache object here: the shadow checks its uncached calls only")
    ids = torch.randint(5, 60, (2, 5), generator=torch.Generator().manual_seed(0))
    mask = torch.cat([RIGHT, torch.ones(2, 1, dtype=RIGHT.dtype)], 1)
    with torch.no_grad(), hfpatch.shadow(rate=1.0) as report:
        cache = model(
            input_ids=ids, attention_mask=RIGHT, past_key_values=make_dynamic_cache(model)
        ).past_key_values
        copied = copy.deepcopy(cache)
        model(input_ids=ids[:, :1], attention_mask=mask, past_key_values=copied)  # followed: its keys
        if hasattr(cache, "reorder_cache"):
            cache.reorder_cache(torch.tensor([1, 0]))  # rows swapped in place: the history is wrong now
            model(input_ids=ids[:, :1], attention_mask=mask.flip(0), past_key_values=cache)
    assert report.mismatches == 0, report
    assert report.checked == 4, report  # the first call's rows and the copy's, not the reordered one's


@pytest.mark.parametrize("rate", [-0.1, 1.5, "all", True])
def test_a_bad_rate_is_a_value_error_naming_it(rate):
    with pytest.raises(ValueError, match="rate: expected a share of calls from 0 to 1"):
        with hfpatch.shadow(rate=rate):
            pass


@pytest.mark.slow  # subprocesses through the launcher: nox -s ci runs it
def test_hfpatch_shadow_variable_with_the_launcher():
    environ = {k: v for k, v in os.environ.items() if not k.startswith("HFPATCH_")}
    run = [sys.executable, "-m", "hfpatch", "run", "--", sys.executable, "-c"]
    bad = subprocess.run([*run, "pass"], env={**environ, "HFPATCH_SHADOW": "often"}, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert bad.returncode == 2 and bad.stderr.strip().endswith(
        "hfpatch run: HFPATCH_SHADOW=often: expected a share of calls from 0 to 1"
    ), bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
    if arch_skip_reason("gpt2"):
        pytest.skip(arch_skip_reason("gpt2"))
    script = (
        "import torch, hfpatch\n"
        "from hfpatch.verification.tiny import tiny_model\n"
        "model = tiny_model('gpt2')\n"
        "with torch.no_grad():\n"
        "    ids, mask = torch.tensor([[5, 6, 7], [8, 9, 10]]), torch.tensor([[0, 1, 1], [1, 1, 1]])\n"
        "    model(input_ids=ids, attention_mask=mask)\n"
        "print(dict(hfpatch.status().shadow))\n"
    )  # fmt: skip
    done = subprocess.run([*run, script], env={**environ, "HFPATCH_SHADOW": "1"}, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "'checked': 2, 'mismatches': 0" in done.stdout, done.stdout  # every row at rate 1
    assert "hfpatch shadow (process" in done.stderr and "2 rows checked, 0 mismatches" in done.stderr


def test_packed_rows_are_checked_one_sequence_at_a_time(model):
    """A packed batch (positions restarting): on stock its later sequences see the earlier ones, which
    the shadow finds by running a sequence alone with its positions; patched, where this release keeps
    packed rows, it finds nothing. The live logits are the same bits either way."""
    from packaging.version import Version

    from conftest import TF
    from expectations import PACKED_FROM

    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]])
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 0, 1, 2, 3, 4]])
    arch = model.config.model_type
    with torch.no_grad():
        with hfpatch.unpatched():
            plain = model(input_ids=ids, position_ids=positions).logits
        with hfpatch.unpatched(), warnings.catch_warnings(), hfpatch.shadow(rate=1.0) as report:
            warnings.simplefilter("ignore")
            watched = [model(input_ids=ids, position_ids=positions).logits for _ in range(6)]
    assert all(torch.equal(plain, logits) for logits in watched)
    assert report.checked == 18 and report.mismatches == 12 and report.worst > 1e-3, report  # all 3 sequences
    if TF >= Version(PACKED_FROM[arch]):
        with hfpatch.shadow(rate=1.0) as report, torch.no_grad():
            for _ in range(6):
                model(input_ids=ids, position_ids=positions)
        assert report.checked == 18 and report.mismatches == 0, report


def test_generate_steps_are_checked(model):
    """generate() passes the mask's positions at every step: each step is checked, and on stock the
    left-padded prefill of GPT-2 is found (generate() itself passes right positions: its steps right)."""
    ids = torch.randint(5, 60, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), spying(model) as seen, hfpatch.shadow(rate=1.0) as report:
        model.generate(input_ids=ids, attention_mask=LEFT, max_new_tokens=3, do_sample=False, pad_token_id=0)
    # the prefill, and each step generate() hands a Cache object (a legacy tuple is let go: 4.41's generate()
    # hands Llama tuples, though Llama returns a Cache object it is given)
    handed = [next((v for k, v in call.items() if k in ("past_key_values", "cache")), None) for call in seen]
    steps = 1 + sum(1 for cache in handed[1:] if cache is not None and not isinstance(cache, (tuple, list)))
    steps = steps if followed(model) else 1
    kinds = [type(cache).__name__ for cache in handed]
    assert report.checked == 2 * steps and report.mismatches == 0, (report, kinds)


@pytest.mark.slow  # a subprocess under hfpatch audit: nox -s ci runs it
def test_the_shadow_under_hfpatch_audit():
    """HFPATCH_SHADOW with hfpatch audit: the audited process runs stock, and the shadow checks it."""
    if arch_skip_reason("gpt2"):
        pytest.skip(arch_skip_reason("gpt2"))
    environ = {k: v for k, v in os.environ.items() if not k.startswith("HFPATCH_")}
    script = (
        "import torch\n"
        "from hfpatch.verification.tiny import tiny_model\n"
        "model = tiny_model('gpt2')\n"
        "with torch.no_grad():\n"
        "    ids, mask = torch.tensor([[5, 6, 7], [8, 9, 10]]), torch.tensor([[0, 1, 1], [1, 1, 1]])\n"
        "    model(input_ids=ids, attention_mask=mask)\n"
    )  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "hfpatch", "audit", "--", sys.executable, "-c", script],
        env={**environ, "HFPATCH_SHADOW": "1"}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "2 rows checked, 1 mismatches" in done.stderr, done.stderr  # stock GPT-2's left-padded row


def test_calls_with_labels_are_checked_and_what_is_let_go_is_counted():
    """A task head's call with labels (Trainer.evaluate's): the base model gets Trainer's token count for
    the loss beside its inputs; the logits are compared all the same (stock GPT-2, left padding: row 0
    wrong). A call the shadow lets go is counted in status().shadow['skipped'], by reason."""
    if arch_skip_reason("gpt2"):
        pytest.skip(arch_skip_reason("gpt2"))
    model = tiny_model("gpt2")
    ids = torch.randint(5, 60, (2, 5), generator=torch.Generator().manual_seed(0))
    labels = ids.masked_fill(LEFT == 0, -100)
    before = dict(hfpatch.status().shadow["skipped"])
    counted = 2
    with torch.no_grad(), hfpatch.unpatched(), pytest.warns(hfpatch.ShadowMismatch):
        with hfpatch.shadow(rate=1.0) as report:
            model(input_ids=ids, attention_mask=LEFT, labels=labels)
            try:
                model(input_ids=ids, attention_mask=LEFT, labels=labels, num_items_in_batch=torch.tensor(6))
            except TypeError:  # a release whose heads take no num_items_in_batch (before 4.46)
                counted = 1
            model.train()
            model(input_ids=ids, attention_mask=LEFT, labels=labels)  # dropout: not checked
            model.eval()
    assert report.checked == 2 * counted and report.mismatches == counted, report
    assert report.skipped == {"training mode (dropout)": 1}, report
    after = hfpatch.status().shadow["skipped"]
    assert after["training mode (dropout)"] == before.get("training mode (dropout)", 0) + 1
