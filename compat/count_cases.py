"""Count randomized padding / cache-split cases that are wrong on stock transformers and on hfpatch.

    python compat/count_cases.py OUT.json [--cases 40]

The same cases (fixed seeds, ``compat/cases.py``'s ``random_case``: the property tests' generator) on every
release, for the flagship architectures: a batch of 1-3 rows, 1-3 KV-cached calls, 0-4 new tokens
per row and call, each row padded left or right per call. A case is wrong when some real
token's logits differ from the row run alone, unpadded, by more than 1e-5.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import hfpatch  # noqa: E402
from compat.cases import TOLERANCE, max_diff, random_case, run_padded  # noqa: E402
from compat.vocabulary import FLAGSHIPS  # noqa: E402
from hfpatch.support import release_has  # noqa: E402
from hfpatch.verification.tiny import tiny_model  # noqa: E402


def count(arch: str, cases: int) -> dict[str, int]:
    """Cases wrong on stock and with hfpatch; a case that raises counts as wrong, and as an error."""
    model = tiny_model(arch)
    result = {"cases": cases, "stock_wrong": 0, "hfpatch_wrong": 0, "stock_errors": 0, "hfpatch_errors": 0}
    rng = random.Random(1234)
    for _ in range(cases):
        rows, chunks, left = random_case(rng)
        for name in ("stock", "hfpatch"):
            context = hfpatch.unpatched(arch) if name == "stock" else hfpatch.patched(arch)
            try:
                with context:
                    got = run_padded(model, rows, chunks, left)
                wrong = max_diff(model, rows, got) > TOLERANCE
            except Exception:  # noqa: BLE001 - an upstream crash is a result
                result[f"{name}_errors"] += 1
                wrong = True
            result[f"{name}_wrong"] += wrong
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--cases", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(1)
    status = hfpatch.apply(FLAGSHIPS)
    result = {}
    for arch in FLAGSHIPS:
        present = release_has(hfpatch.registry()[arch])
        result[arch] = {"present": present}
        if present and status[arch].state != "skipped":
            result[arch].update(count(arch, args.cases))
    status = hfpatch.status()  # after the models were built, so their modules are imported
    for arch in FLAGSHIPS:
        result[arch].update(state=status[arch].state, reason=status[arch].reason)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
