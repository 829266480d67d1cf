"""``apply(unpad=True)`` with the libraries that pad batches, in their own ways of calling the model:
transformers' ``Trainer`` with ``DataCollatorForLanguageModeling``, a PEFT LoRA model, TRL's
``SFTTrainer`` (no ``padding_free``), ``DPOTrainer`` and GRPO's per-token log-probs. Each trainer's own
``compute_loss`` on its first batch, forward and backward: the loss and every gradient equal the padded
path's, and the call really ran on its real tokens (``status().unpadded``)."""

from __future__ import annotations

import copy
import types

import pytest
import torch

import hfpatch
from hfpatch._context import UNPADDED
from hfpatch.verification.tiny import tiny_model

from harness import VOCAB, run_alone

pytest.importorskip("accelerate")  # what transformers' Trainer needs

NO_DROPOUT = {"attention_dropout": 0.0}
# skewed lengths: about half the slots of a batch are pads (hfpatch.unpad.WORTH leaves nearly full ones)
ROWS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [17, 18, 19], [20, 21, 22, 23], [24, 25]]


def tokenizer():
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    words = Tokenizer(WordLevel(vocab, unk_token="t3"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t0", eos_token="t2", unk_token="t3")


def grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def both_ways(step) -> None:
    """``step()`` (the trainer's loss of its batch, backward) padded, then with ``apply(unpad=True)``:
    the same loss and gradients, and the unpadded one ran on the real tokens."""
    model_grads = []
    losses = []
    for unpad in (False, True):
        calls = UNPADDED["calls"]
        hfpatch.apply(unpad=unpad)
        try:
            loss, model = step()
        finally:
            hfpatch.apply(unpad=False)
        assert (UNPADDED["calls"] > calls) == unpad, UNPADDED
        losses.append(loss)
        model_grads.append(grads(model))
    assert abs(losses[0] - losses[1]) <= 1e-5 * max(1.0, abs(losses[0])), losses
    for name, want in model_grads[0].items():
        got = model_grads[1][name]
        assert ((got - want).norm() / want.norm().clamp(min=1e-12)).item() <= 1e-4, name


def _loss(trainer, model, batch) -> tuple[float, object]:
    model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(model, batch)
    loss.backward()
    return loss.item(), model


@pytest.mark.parametrize("with_lora", [False, True], ids=["plain", "peft-lora"])
def test_trainer_with_a_padding_collator(tmp_path, with_lora):
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    model = tiny_model("llama", attention="sdpa", sizes=NO_DROPOUT).train()
    if with_lora:
        peft = pytest.importorskip("peft")
        torch.manual_seed(1)
        config = peft.LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)
        model = peft.get_peft_model(model, config).train()
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, report_to=[], use_cpu=True
    )
    collator = DataCollatorForLanguageModeling(tokenizer(), mlm=False)
    trainer = Trainer(
        model=model, args=args, train_dataset=[{"input_ids": r} for r in ROWS], data_collator=collator
    )
    batch = next(iter(trainer.get_train_dataloader()))
    assert bool((batch["attention_mask"] == 0).any())  # padded
    both_ways(lambda: _loss(trainer, model, batch))


@pytest.mark.slow
@pytest.mark.compile
def test_trainer_with_torch_compile(tmp_path):
    """``TrainingArguments(torch_compile=True)``: the Trainer compiles the model itself (dynamo, graphs
    may break); two training steps on padded batches give the padded run's logged losses and weights,
    and the unpadded run's calls ran on their real tokens."""
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    base = tiny_model("llama", attention="sdpa", sizes=NO_DROPOUT).train()
    results = []
    for unpad in (False, True):
        model = copy.deepcopy(base)
        args = TrainingArguments(
            output_dir=str(tmp_path / str(unpad)), per_device_train_batch_size=2, max_steps=2,
            logging_steps=1,
            learning_rate=5e-5, report_to=[], use_cpu=True, torch_compile=True,
            torch_compile_backend="aot_eager", save_strategy="no",
        )  # fmt: skip
        collator = DataCollatorForLanguageModeling(tokenizer(), mlm=False)
        trainer = Trainer(
            model=model, args=args, train_dataset=[{"input_ids": r} for r in ROWS], data_collator=collator
        )
        calls = UNPADDED["calls"]
        hfpatch.apply(unpad=unpad)
        torch._dynamo.reset()
        try:
            trainer.train()
        finally:
            hfpatch.apply(unpad=False)
            torch._dynamo.reset()
        assert (UNPADDED["calls"] > calls) == unpad, UNPADDED
        assert hasattr(
            trainer.model_wrapped, "_orig_mod"
        )  # (the Trainer's own torch.compile, via accelerate)
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        results.append((losses, {n: p.detach().clone() for n, p in model.named_parameters()}))
    (padded, padded_weights), (unpadded, unpadded_weights) = results
    assert len(padded) == 2 and all(abs(a - b) <= 1e-5 * max(1.0, abs(a)) for a, b in zip(padded, unpadded))
    # (Adam moves each weight by about the learning rate a step whatever its gradient's size: the runs'
    # float rounding shows in the weights as a small share of how far they moved)
    moved = max(
        (w - p.detach()).abs().max().item() for (n, w), p in zip(padded_weights.items(), base.parameters())
    )
    apart = max((unpadded_weights[n] - w).abs().max().item() for n, w in padded_weights.items())
    assert apart <= 0.01 * moved, (apart, moved)


def test_trl_sft_trainer_without_padding_free(tmp_path):
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    model = tiny_model("llama", attention="sdpa", sizes=NO_DROPOUT).train()
    config = trl.SFTConfig(
        output_dir=str(tmp_path), padding_free=False, max_length=None, per_device_train_batch_size=4,
        report_to=[], use_cpu=True, eos_token="t2", bf16=False,
    )  # fmt: skip
    data = datasets.Dataset.from_dict({"input_ids": ROWS})
    trainer = trl.SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer())
    batch = next(iter(trainer.get_train_dataloader()))
    assert "attention_mask" in batch and bool((batch["attention_mask"] == 0).any())
    both_ways(lambda: _loss(trainer, model, batch))


def test_trl_dpo_trainer(tmp_path):
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    model = tiny_model("llama", attention="sdpa", sizes=NO_DROPOUT).train()

    def text(row: list[int]) -> str:
        return " ".join(f"t{i}" for i in row)

    data = datasets.Dataset.from_dict({  # (TRL joins prompt and completion as they are: the space)
        "prompt": [text(r[:2]) for r in ROWS],
        "chosen": [" " + text(r[2:] or [31]) for r in ROWS],
        "rejected": [" " + text(list(reversed(r[2:])) or [30]) for r in ROWS],
    })  # fmt: skip
    config = trl.DPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, report_to=[], use_cpu=True, bf16=False,
        max_length=None,
    )  # fmt: skip
    reference = copy.deepcopy(model).eval()
    trainer = trl.DPOTrainer(
        model=model, ref_model=reference, args=config, train_dataset=data, processing_class=tokenizer()
    )
    batch = next(iter(trainer.get_train_dataloader()))
    both_ways(lambda: _loss(trainer, model, batch))


def test_grpo_per_token_log_probs():
    """GRPO scores left-padded prompt + right-padded completion rows in one call, with the mask, through
    TRL's fused LM head (log-probs from the completions' labels; the scoring call that keeps the logits
    themselves is tests/test_unpad.py's): run on the real tokens, each row's log-probs its own."""
    grpo = pytest.importorskip("trl.trainer.grpo_trainer")
    trl_utils = pytest.importorskip("trl.trainer.utils")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    model = tiny_model("gpt2")
    trl_utils.add_fused_lm_head(model)  # (GRPOTrainer's own: log-probs from the labels)
    prompts, completions = [[5, 6], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16]], [[20, 21, 22], [23, 24]]
    width, length = max(map(len, prompts)), max(map(len, completions))
    ids = torch.tensor(
        [[0] * (width - len(p)) + p + c + [0] * (length - len(c)) for p, c in zip(prompts, completions)]
    )
    mask = torch.tensor(
        [[0] * (width - len(p)) + [1] * (len(p) + len(c)) + [0] * (length - len(c))
         for p, c in zip(prompts, completions)]
    )  # fmt: skip
    AcceleratorState._reset_state(True)
    trainer = types.SimpleNamespace(accelerator=Accelerator(cpu=True, mixed_precision="no"))
    reference = []
    for p, c in zip(prompts, completions):
        logits = run_alone(model, p + c)[len(p) - 1 : -1]
        reference.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(c)[:, None])[:, 0])
    calls = UNPADDED["calls"]
    hfpatch.apply(unpad=True)
    try:
        with torch.no_grad():
            scored = grpo.GRPOTrainer._get_per_token_logps_and_entropies(trainer, model, ids, mask, length)
    finally:
        hfpatch.apply(unpad=False)
    assert UNPADDED["calls"] == calls + 1
    logps = scored[0]
    for r, own in enumerate(reference):  # (each completion's real tokens: its pads' are masked out by GRPO)
        assert (logps[r, : len(own)] - own).abs().max().item() <= 1e-5
