"""Count randomized padding / cache-split cases that are wrong on stock transformers and on hfpatch.

    python compat/count_cases.py OUT.json [--cases 40]

The same cases (fixed seeds) on every release: a batch of 1-3 rows, 1-3 KV-cached calls, 0-4 new
tokens per row and call, each row padded left or right per call. A case is wrong when some real
token's logits differ from the row run alone, unpadded, by more than 1e-5.
"""

from __future__ import annotations

import argparse
import json
import random

import torch

import hfpatch
from hfpatch import doctor, engine
from hfpatch.gates import release_has

TOLERANCE = 1e-5


def random_case(rng: random.Random) -> tuple[list[list[int]], list[list[int]], list[list[bool]]]:
    batch, calls = rng.randint(1, 3), rng.randint(1, 3)
    chunks = [[rng.randint(0, 4) for _ in range(batch)] for _ in range(calls)]
    for r in range(batch):
        if sum(c[r] for c in chunks) == 0:
            chunks[0][r] = rng.randint(1, 4)
    left = [[rng.random() < 0.5 for _ in range(batch)] for _ in range(calls)]
    rows = [
        [rng.randint(1, doctor.VOCAB - 1) for _ in range(sum(c[r] for c in chunks))] for r in range(batch)
    ]
    return rows, chunks, left


def count(arch: str, cases: int) -> dict[str, int]:
    """Cases wrong on stock and with hfpatch; a case that raises counts as wrong, and as an error."""
    model = doctor.tiny_model(arch)
    result = {"cases": cases, "stock_wrong": 0, "hfpatch_wrong": 0, "stock_errors": 0, "hfpatch_errors": 0}
    rng = random.Random(1234)
    for _ in range(cases):
        rows, chunks, left = random_case(rng)
        for name in ("stock", "hfpatch"):
            (hfpatch.revert if name == "stock" else hfpatch.apply)()
            try:
                wrong = (
                    doctor.max_diff(model, rows, doctor.run_batched(model, rows, chunks, left)) > TOLERANCE
                )
            except Exception:  # noqa: BLE001 - an upstream crash (transformers 4.36-4.37 SDPA masks) is a result
                result[f"{name}_errors"] += 1
                wrong = True
            result[f"{name}_wrong"] += wrong
    hfpatch.apply()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--cases", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(1)
    status = hfpatch.apply()
    result = {}
    for entry in status.adapters:
        present = release_has(engine._registry[entry.arch])
        result[entry.arch] = {"present": present}
        if present and entry.state != engine.SKIPPED:
            result[entry.arch].update(count(entry.arch, args.cases))
    for entry in hfpatch.status().adapters:  # after the models were built, so their modules are imported
        result[entry.arch].update(state=entry.state, reason=entry.reason)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
