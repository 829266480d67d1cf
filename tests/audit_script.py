"""A script for tests/test_audit.py: tiny GPT-2, Llama and Mistral (window 3) models, called as a user
would (padded batches, unpadded ones, right-padded cached prefixes continued, left padding in one
call), every call's inputs and logits saved to ``sys.argv[1]``. Run stock, and under ``hfpatch
audit``: the logits must be the same bits, and the audit's counts what each row alone says."""

from __future__ import annotations

import sys

import torch

from hfpatch.verification.tiny import tiny_model

WINDOW = 3


def build(arch: str) -> torch.nn.Module:
    """The script's model of ``arch`` (the same weights every time)."""
    if arch == "mistral":
        return tiny_model("mistral", seed=3, attention="eager", sizes={"sliding_window": WINDOW})
    return tiny_model(arch, seed={"gpt2": 1, "llama": 2}[arch])


# (model type, [(new tokens' mask columns per row), ...]): each chain's calls share one cache; a row's
# mask is its chain's columns so far
CHAINS = [
    ("gpt2", [[[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 1]]]),  # left padding, one call
    ("gpt2", [[[1, 1, 1, 1], [1, 1, 1, 1]]]),  # no padding
    ("gpt2", [[[1, 1, 1, 0], [1, 1, 1, 1]], [[1], [1]]]),  # a right-padded prefix + 1 token
    ("gpt2", [[[1, 1, 0, 0], [1, 1, 1, 1]], [[1, 1, 1], [0, 1, 1]]]),  # holes, + 3 tokens
    ("llama", [[[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]]),  # left padding, one call: right on stock
    ("llama", [[[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]]),  # right padding, one call: right on stock
    ("llama", [[[1, 1, 1, 0], [1, 1, 1, 1]], [[1, 1], [1, 1]], [[1], [1]]]),  # holes, then decode
    ("llama", [[[0, 1, 1, 1], [1, 1, 1, 1]], [[1, 1], [1, 1]]]),  # left-padded prefix + 2: right
    ("mistral", [[[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]]]),  # left padding past the window: right
    ("mistral", [[[1, 1, 0, 0], [1, 1, 1, 1]], [[1, 1, 1, 1], [1, 1, 1, 1]]]),  # holes inside the window
    ("mistral", [[[1, 0, 1, 1, 1], [1, 1, 1, 1, 1]], [[1], [1]]]),  # a hole, then decode
]


def run(path: str) -> None:
    built = {arch: build(arch) for arch in dict(CHAINS)}
    generator = torch.Generator().manual_seed(0)
    records = []
    with torch.no_grad():
        for arch, calls in CHAINS:
            model, cache, columns, ids_so_far = built[arch], None, None, None
            for rows in calls:
                new = torch.tensor(rows)
                ids = torch.randint(3, 60, new.shape, generator=generator)
                columns = new if columns is None else torch.cat([columns, new], 1)
                ids_so_far = ids if ids_so_far is None else torch.cat([ids_so_far, ids], 1)
                out = model(input_ids=ids, attention_mask=columns, past_key_values=cache, use_cache=True)
                cache = out.past_key_values
                records.append({"arch": arch, "ids": ids_so_far.clone(), "mask": columns.clone(),
                                "new": ids.shape[1], "logits": out.logits.clone()})  # fmt: skip
    torch.save(records, path)


if __name__ == "__main__":
    run(sys.argv[1])
