"""PEFT and TRL, as their users call the model: a LoRA model (and the merged one) on a padded batch
and a padded cached prefix; TRL's GRPO per-token log-probs (left-padded prompts + completions in
one call, through TRL's own fused LM head and its trainer's own method). Stock is wrong, hfpatch
exact, against the unpadded reference."""

from __future__ import annotations

import types

import pytest
import torch

from compat.vocabulary import FLAGSHIPS
from hfpatch.verification.scenarios import SCENARIOS, Scenario, scenario_rows
from hfpatch.verification.tiny import tiny_model

from conftest import arch_skip_reason, stock
from expectations import ABSOLUTE
from harness import PAD, TOLERANCE, WRONG, cache_kwarg, max_diff, run_alone, run_padded

peft = pytest.importorskip("peft")


@pytest.fixture(params=FLAGSHIPS)
def lora(request):
    reason = arch_skip_reason(request.param)
    if reason:
        pytest.skip(reason)
    base = tiny_model(request.param)
    config = peft.LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)
    torch.manual_seed(1)
    return peft.get_peft_model(base, config).eval()


def _errors(model, cache_name):
    out = {}
    for scenario in SCENARIOS:
        rows = scenario_rows(scenario)
        got = run_padded(model, rows, scenario.chunks, scenario.left, cache_name=cache_name)
        out[scenario.name] = max_diff(model, rows, got)
    return out


@pytest.mark.parametrize("merged", [False, True], ids=["lora", "merged"])
def test_peft_lora(lora, merged):
    model = lora.merge_and_unload() if merged else lora
    name = cache_kwarg(lora.get_base_model() if not merged else model)
    assert max(_errors(model, name).values()) <= TOLERANCE
    with stock():
        assert max(_errors(model, name).values()) > WRONG


def test_trl_grpo_per_token_log_probs():
    """GRPO scores left-padded prompt + completion rows in one call, with the mask and no positions:
    TRL's GRPOTrainer._get_per_token_logps_and_entropies, on a model with TRL's fused LM head."""
    trl_utils = pytest.importorskip("trl.trainer.utils")
    grpo = pytest.importorskip("trl.trainer.grpo_trainer")
    from accelerate import Accelerator

    # absolute positions: left padding shifts them on stock (RoPE models are blind to a uniform shift)
    arch = ABSOLUTE
    if arch_skip_reason(arch):
        pytest.skip(arch_skip_reason(arch))
    model = tiny_model(arch)
    trl_utils.add_fused_lm_head(model)
    prompts = scenario_rows(Scenario("prompts", (3, 5), ((3, 5),), ((True, True),)))
    completions = scenario_rows(Scenario("completions", (4, 4), ((4, 4),), ((False, False),)), 7)
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (width - len(p)) + p + c for p, c in zip(prompts, completions)])
    mask = (torch.arange(ids.shape[1])[None] >= torch.tensor([[width - len(p)] for p in prompts])).long()
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)  # a trainer made earlier in this process leaves its state (bf16)
    accelerator = Accelerator(cpu=True, mixed_precision="no")
    trainer = types.SimpleNamespace(accelerator=accelerator)  # what the method reads of self

    def log_probs():
        with torch.no_grad():
            logps, _, _ = grpo.GRPOTrainer._get_per_token_logps_and_entropies(trainer, model, ids, mask, 4)
        return logps

    reference = []
    for p, c in zip(prompts, completions):
        logits = run_alone(model, p + c)[len(p) - 1 : -1]
        reference.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(c)[:, None])[:, 0])
    reference = torch.stack(reference)
    assert (log_probs() - reference).abs().max().item() <= TOLERANCE
    with stock():
        assert (log_probs() - reference).abs().max().item() > WRONG
