"""Mixed-precision training as its users run it: ``Trainer(bf16=True)`` (``torch.autocast`` to bf16 over
fp32 weights, which TRL's configs default to), SDPA, on the CPU. A packed batch
(``DataCollatorWithFlattening``, TRL's ``padding_free=True``) under ``apply()``, and a padded one
(``DataCollatorForLanguageModeling``, TRL's SFT without ``padding_free``) under ``apply(unpad=True)``:
each trainer's own first step (``train()``, one step at learning rate 0) runs (it raised before), its
layers under autocast, with the loss and gradients of the same sequences each run alone in the same
regime, within bf16's tolerance."""

from __future__ import annotations

import pytest
import torch
from test_unpad_trainers import tokenizer

import hfpatch
from hfpatch._context import UNPADDED
from hfpatch.tolerances import bound
from hfpatch.verification.tiny import tiny_model

from conftest import stock

pytest.importorskip("accelerate")  # what transformers' Trainer needs

SEQUENCES = ([5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [15, 16, 17], [18, 19, 20, 21], [22, 23])
NO_DROPOUT = {"attention_dropout": 0.0}
BF16 = bound(torch.bfloat16)  # the regime's share (of |loss|; of a gradient's norm, ten times it)


def alone(model) -> tuple[float, dict]:
    """The loss and gradients of the sequences each run alone under autocast to bf16, weighted by their
    share of the targets (what a packed or padded batch's token mean is)."""
    total = sum(len(seq) - 1 for seq in SEQUENCES)
    model.zero_grad(set_to_none=True)
    loss = 0.0
    with stock():
        for seq in SEQUENCES:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(input_ids=torch.tensor([seq]), labels=torch.tensor([seq]))
            (out.loss * (len(seq) - 1) / total).backward()
            loss += out.loss.item() * (len(seq) - 1) / total
    return loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def trained(trainer, model, unpad: bool) -> tuple[float, dict, bool]:
    """The trainer's own first step (``train()``, one step at learning rate 0): its loss, its gradients
    (taken as backward computes them), and whether the layers ran under autocast to bf16."""
    seen, losses, grads = [], [], {}
    inner = model.get_decoder()

    def autocast(*_):
        seen.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)

    def keep(name):
        return lambda grad: grads.__setitem__(name, grad.clone())

    hooks = [
        inner.register_forward_pre_hook(autocast),
        model.register_forward_hook(lambda _m, _a, out: losses.append(float(out.loss))),
        *(p.register_hook(keep(n)) for n, p in model.named_parameters()),
    ]
    hfpatch.apply(unpad=unpad)
    try:
        calls = UNPADDED["calls"]
        trainer.train()
        assert (UNPADDED["calls"] > calls) == unpad, dict(UNPADDED)
    finally:
        hfpatch.apply(unpad=False)
        for hook in hooks:
            hook.remove()
    return losses[0], grads, seen == [torch.bfloat16]


def check(trainer, model, unpad: bool) -> None:
    want_loss, want = alone(model)
    loss, grads, autocast = trained(trainer, model, unpad)
    assert autocast, "the trainer's forward did not run under autocast to bf16"
    assert abs(loss - want_loss) <= BF16 * max(1.0, abs(want_loss)), (loss, want_loss)
    for name, g in want.items():
        assert ((grads[name] - g).norm() / g.norm().clamp(min=1e-12)).item() <= 10 * BF16, name


def _args(tmp_path, **extra):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, report_to=[], use_cpu=True, bf16=True,
        remove_unused_columns=False, max_steps=1, learning_rate=0.0, save_strategy="no", **extra,
    )  # fmt: skip


@pytest.mark.parametrize("collator", ["DataCollatorWithFlattening", "DataCollatorForLanguageModeling"])
def test_trainer_in_bf16(tmp_path, collator):
    import transformers

    model = tiny_model("llama", attention="sdpa", sizes=NO_DROPOUT).train()
    packed = collator == "DataCollatorWithFlattening"
    made = (
        transformers.DataCollatorWithFlattening()
        if packed
        else transformers.DataCollatorForLanguageModeling(tokenizer(), mlm=False)
    )
    data = [{"input_ids": list(seq)} for seq in SEQUENCES]
    trainer = transformers.Trainer(model=model, args=_args(tmp_path), train_dataset=data, data_collator=made)
    check(trainer, model, unpad=not packed)


@pytest.mark.parametrize("padding_free", [True, False], ids=["padding_free", "padded"])
def test_trl_sft_trainer_in_bf16(tmp_path, padding_free):
    """TRL's SFT, whose config defaults to ``bf16=True``: packed under ``apply()``, padded under
    ``apply(unpad=True)``."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    model = tiny_model("llama", attention="sdpa", sizes=NO_DROPOUT).train()
    config = trl.SFTConfig(
        output_dir=str(tmp_path), padding_free=padding_free, max_length=None, per_device_train_batch_size=4,
        report_to=[], use_cpu=True, eos_token="t2", bf16=True, max_steps=1, learning_rate=0.0,
        save_strategy="no",
    )  # fmt: skip
    data = datasets.Dataset.from_dict({"input_ids": [list(seq) for seq in SEQUENCES]})
    trainer = trl.SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer())
    check(trainer, model, unpad=not padding_free)
