"""``hfpatch.shadow`` on transformers' ``Trainer.evaluate()`` and ``predict()``: a left-padded GPT-2 batch
made by ``DataCollatorForLanguageModeling`` (labels, Trainer's token count for the loss), on stock. Every
row with pads is wrong there (absolute positions shifted), and every such row is flagged; with hfpatch
none is."""

from __future__ import annotations

import warnings

import pytest
import torch

import hfpatch
from hfpatch.verification.tiny import tiny_model

from harness import VOCAB

pytest.importorskip("accelerate")  # what transformers' Trainer needs

ROWS = ([5, 6, 7], [8, 9, 10, 11, 12], [13, 14], [15, 16, 17, 18, 19], [20, 21, 22, 23], [24, 25, 26, 27, 28])


def trainer(tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import (
        DataCollatorForLanguageModeling,
        PreTrainedTokenizerFast,
        Trainer,
        TrainingArguments,
    )

    vocab = {f"t{i}": i for i in range(VOCAB)}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t3")), pad_token="t0", padding_side="left"
    )
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_eval_batch_size=2, report_to=[], use_cpu=True,
    )  # fmt: skip
    model = tiny_model("gpt2").eval()
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    data = [{"input_ids": row} for row in ROWS]
    return Trainer(model=model, args=args, eval_dataset=data, data_collator=collator), data


@pytest.mark.parametrize("side", ["stock", "hfpatch"])
def test_the_shadow_checks_evaluate_and_predict(tmp_path, side):
    run, data = trainer(tmp_path)
    padded_rows = 2 * sum(len(a) != len(b) for a, b in zip(ROWS[::2], ROWS[1::2]))  # one a batch, twice
    context = hfpatch.unpatched() if side == "stock" else torch.no_grad()
    with context, warnings.catch_warnings(record=True), hfpatch.shadow(rate=1.0) as report:
        warnings.simplefilter("always")
        run.evaluate()
        run.predict(data)
    assert report.checked == 2 * len(ROWS), report  # every row of every batch, twice
    assert report.skipped == {}, report
    assert report.mismatches == (padded_rows if side == "stock" else 0), report
