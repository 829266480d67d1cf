"""Why a bf16 training run under ``apply(unpad=True)`` drifts from the padded run, against a control:
TRL's ``DPOTrainer`` (its defaults: learning rate 1e-6, Adam), tiny Llama, SDPA, 8 pairs of skewed lengths,
3 steps of 4 pairs, padded and unpadded, in bf16 (``bf16=True``, TRL's default: autocast on this CPU) and in
fp32. Each run in a process of its own, one torch thread. Needs trl (``nox -s integrations`` installs it).

    python benchmarks/drift.py                       # the section for RESULTS.md
    python benchmarks/drift.py --one unpad bf16      # one run: its JSON line
    python benchmarks/drift.py --trainer control     # one Trainer run: its JSON line
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROWS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [17, 18, 19], [20, 21, 22, 23], [24, 25]] * 2
METRICS = ("grad_norm", "logps/chosen", "logps/rejected", "rewards/chosen", "loss")


def one(mode: str, precision: str) -> dict:
    import torch

    torch.set_num_threads(1)
    import datasets
    import trl

    import hfpatch
    from hfpatch.verification.tiny import tiny_model

    tokenizer = _tokenizer()
    hfpatch.apply(unpad=mode == "unpad")
    model = tiny_model("llama", attention="sdpa", sizes={"attention_dropout": 0.0}).train()

    def text(row: list[int]) -> str:
        return " ".join(f"t{i}" for i in row)

    data = datasets.Dataset.from_dict({
        "prompt": [text(r[:2]) for r in ROWS],
        "chosen": [" " + text(r[2:] or [31]) for r in ROWS],
        "rejected": [" " + text(list(reversed(r[2:])) or [30]) for r in ROWS],
    })  # fmt: skip
    with tempfile.TemporaryDirectory() as out:
        config = trl.DPOConfig(
            output_dir=out, per_device_train_batch_size=4, report_to=[], use_cpu=True, max_length=None,
            bf16=precision == "bf16", max_steps=3, logging_steps=1, seed=0, data_seed=0, save_strategy="no",
        )  # fmt: skip
        reference = copy.deepcopy(model).eval()
        trainer = trl.DPOTrainer(
            model=model, ref_model=reference, args=config, train_dataset=data, processing_class=tokenizer
        )
        trainer.train()
    logs = [{k: h[k] for k in METRICS if k in h} for h in trainer.state.log_history if "loss" in h]
    weights = torch.cat([p.detach().float().flatten() for p in model.parameters()])
    return {"logs": logs, "weights": weights.tolist(), "unpadded": hfpatch.status().unpadded["calls"]}


def trainer_one(mode: str) -> dict:
    """transformers' ``Trainer`` (learning rate 5e-5, AdamW), 4 steps of 4 rows, fp32: padded, unpadded,
    or padded to a multiple of 32 columns (``control``: the same numbers in other shapes)."""
    import torch

    torch.set_num_threads(1)
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    import hfpatch
    from hfpatch.verification.tiny import tiny_model

    hfpatch.apply(unpad=mode == "unpad")
    model = tiny_model("llama", attention="sdpa", sizes={"attention_dropout": 0.0}).train()
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, per_device_train_batch_size=4, report_to=[], use_cpu=True, max_steps=4,
            learning_rate=5e-5, seed=0, data_seed=0, save_strategy="no",
        )  # fmt: skip
        multiple = 32 if mode == "control" else None
        collator = DataCollatorForLanguageModeling(_tokenizer(), mlm=False, pad_to_multiple_of=multiple)
        rows = [{"input_ids": r} for r in ROWS * 2]
        Trainer(model=model, args=args, train_dataset=rows, data_collator=collator).train()
    weights = torch.cat([p.detach().float().flatten() for p in model.parameters()])
    return {"weights": weights.tolist(), "unpadded": hfpatch.status().unpadded["calls"]}


def _tokenizer():
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    from hfpatch.verification.tiny import VOCAB

    words = Tokenizer(WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t3"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t0", eos_token="t2", unk_token="t3")


def run(mode: str, precision: str) -> dict:
    done = subprocess.run(
        [sys.executable, __file__, "--one", mode, precision], capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def table() -> list[str]:
    got = {(m, p): run(m, p) for p in ("fp32", "bf16") for m in ("padded", "unpad")}
    lines = [
        "| step | metric | fp32: unpad - padded | bf16: unpad - padded | bf16 padded - fp32 padded | "
        "bf16 unpad - fp32 padded |",
        "|---|---|---|---|---|---|",
    ]
    for step in range(3):
        for metric in ("grad_norm", "logps/chosen"):
            value = {key: run_["logs"][step][metric] for key, run_ in got.items()}
            cells = [
                value["unpad", "fp32"] - value["padded", "fp32"],
                value["unpad", "bf16"] - value["padded", "bf16"],
                value["padded", "bf16"] - value["padded", "fp32"],
                value["unpad", "bf16"] - value["padded", "fp32"],
            ]
            lines.append(f"| {step + 1} | {metric} | " + " | ".join(f"{abs(c):.1e}" for c in cells) + " |")
    weights = {key: run_["weights"] for key, run_ in got.items()}

    def apart(a: tuple, b: tuple) -> float:
        return max(abs(x - y) for x, y in zip(weights[a], weights[b]))

    lines += [
        "",
        f"Weights after 3 steps, largest difference: fp32 unpad - padded {apart(('unpad', 'fp32'), ('padded', 'fp32')):.1e}, "
        f"bf16 unpad - padded {apart(('unpad', 'bf16'), ('padded', 'bf16')):.1e}, bf16 padded - fp32 padded "
        f"{apart(('padded', 'bf16'), ('padded', 'fp32')):.1e}. Unpadded calls: "
        f"{got['unpad', 'fp32']['unpadded']} (fp32), {got['unpad', 'bf16']['unpadded']} (bf16).",
    ]  # fmt: skip
    return lines


def trainer_table() -> list[str]:
    got = {}
    for mode in ("padded", "unpad", "control"):
        done = subprocess.run(
            [sys.executable, __file__, "--trainer", mode], capture_output=True, text=True, check=True
        )
        got[mode] = json.loads(done.stdout.strip().splitlines()[-1])

    def apart(mode: str) -> float:
        return max(abs(x - y) for x, y in zip(got[mode]["weights"], got["padded"]["weights"]))

    return [
        f"transformers' `Trainer`, 4 steps (learning rate 5e-5, AdamW), fp32, weights' largest difference from "
        f"the padded run: unpadded {apart('unpad'):.1e} ({got['unpad']['unpadded']} calls unpadded), the padded "
        f"run padded to a multiple of 32 columns (the control: the same numbers in other shapes) "
        f"{apart('control'):.1e}."
    ]  # fmt: skip


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        print(json.dumps(one(sys.argv[2], sys.argv[3])))
    elif sys.argv[1:2] == ["--trainer"]:
        print(json.dumps(trainer_one(sys.argv[2])))
    else:
        print("\n".join(table() + [""] + trainer_table()))
