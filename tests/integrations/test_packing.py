"""Packed (padding-free) training as its users run it: transformers' ``Trainer`` with
``DataCollatorWithFlattening`` and TRL's ``SFTTrainer(padding_free=True)``, SDPA, on the CPU. Each
trainer's first batch goes through its own ``compute_loss`` and a backward pass: with hfpatch, the loss
and every parameter's gradient are those of the same sequences run alone (the token mean over them);
on stock, the packed sequences see each other."""

from __future__ import annotations

import pytest
import torch

from hfpatch.verification.tiny import tiny_model

from conftest import stock
from harness import VOCAB

pytest.importorskip("accelerate")  # what transformers' Trainer needs

SEQUENCES = ([5, 6, 7, 8, 9, 10], [11, 12, 13], [14, 15, 16, 17, 18])
NO_DROPOUT = {"attention_dropout": 0.0}


def alone(model) -> tuple[float, dict]:
    """The loss and gradients of the sequences each run alone, weighted by their share of the tokens."""
    total = sum(len(seq) - 1 for seq in SEQUENCES)
    model.zero_grad(set_to_none=True)
    loss = 0.0
    with stock():
        for seq in SEQUENCES:
            out = model(input_ids=torch.tensor([seq]), labels=torch.tensor([seq]))
            (out.loss * (len(seq) - 1) / total).backward()
            loss += out.loss.item() * (len(seq) - 1) / total
    return loss, _grads(model)


def _grads(model) -> dict:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def step(trainer, model, batch) -> tuple[float, dict]:
    """The trainer's own loss of ``batch``, backward."""
    model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(model, batch)
    loss.backward()
    return loss.item(), _grads(model)


def relative(got: dict, want: dict) -> float:
    return max(((got[k] - want[k]).norm() / want[k].norm().clamp(min=1e-12)).item() for k in want)


def check(trainer, model) -> None:
    """The trainer's batch as it comes, and with an all-ones mask added (what many trainers pass): exact
    with hfpatch. Stock is right on the first only where transformers' own packed path runs (no mask and
    no cache: 5.x's Trainer turns the cache off), wrong on the second."""
    batch = next(iter(trainer.get_train_dataloader()))
    assert batch["input_ids"].shape[0] == 1 and "position_ids" in batch  # one packed row
    want_loss, want = alone(model)
    for given in (batch, {**batch, "attention_mask": torch.ones_like(batch["input_ids"])}):
        loss, grads = step(trainer, model, given)
        assert abs(loss - want_loss) <= 1e-5 and relative(grads, want) <= 1e-4, (loss, want_loss)
    with stock():
        _, stock_grads = step(trainer, model, given)
    assert relative(stock_grads, want) > 1e-2, "stock's packed step is right here: the test shows nothing"


def test_trainer_with_data_collator_with_flattening(tmp_path):
    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

    model = tiny_model("llama", attention="sdpa", sizes=NO_DROPOUT).train()
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=3, report_to=[], use_cpu=True,
        remove_unused_columns=False,
    )  # fmt: skip
    data = [{"input_ids": seq} for seq in SEQUENCES]
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=DataCollatorWithFlattening())
    check(trainer, model)


def test_trl_sft_trainer_padding_free(tmp_path):
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}  # the token ids themselves: the dataset is tokenized already
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t3")), pad_token="t0", eos_token="t2"
    )
    model = tiny_model("llama", attention="sdpa", sizes=NO_DROPOUT).train()
    config = trl.SFTConfig(
        output_dir=str(tmp_path), padding_free=True, max_length=None, per_device_train_batch_size=3,
        report_to=[], use_cpu=True, eos_token="t2", bf16=False,  # fp32, and no bf16 left to later trainers
    )  # fmt: skip
    data = datasets.Dataset.from_dict({"input_ids": [list(seq) for seq in SEQUENCES]})
    trainer = trl.SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer)
    check(trainer, model)
