"""A script for tests/test_audit.py: tiny GPT-2, Llama and Mistral (window 3) models, called as a user
would (padded batches, unpadded ones, right-padded cached prefixes continued, left padding in one
call, rows packing several sequences), every call's inputs and logits saved to
``sys.argv[1]``. Run stock, and under ``hfpatch
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


# (model type, the lengths of the sequences each row packs, pass the mask?, use_cache): one call each,
# positions restarting at each sequence (rows right-padded to the longest)
PACKED = [
    ("gpt2", [[4, 3]], False, None),  # DataCollatorWithFlattening's batch: the default cache
    ("llama", [[3, 2, 4], [5, 2]], True, None),  # two padded packed rows
    ("llama", [[3, 3]], False, False),  # no mask, no cache: transformers' own packed path (4.53+)
    ("mistral", [[6, 5]], False, None),  # window 3: a token 4 or more into its sequence sees only it
    ("mistral", [[6, 5]], False, False),  # transformers' own packed path, its mask function picked by window
]


# (model type, the prompt's mask columns per row, new tokens per row): the prompt run once into a cache,
# then generate() continues a deep copy of it (transformers' prompt-reuse recipe) with the new tokens;
# generate() passes the mask's positions at every step
GENERATE = [
    ("mistral", [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], 2),  # a right-padded prompt: holes inside the window
    ("llama", [[0, 0, 1, 1], [1, 1, 1, 1]], 2),  # a left-padded prompt numbered by column, then by the mask
    ("gpt2", [[1, 1, 1, 1], [1, 1, 1, 1]], 2),  # no padding: right
]
STEPS = 3  # generate()'s new tokens: its calls


def generate_calls(model: torch.nn.Module, prompt_mask: list, new: int, generator: torch.Generator) -> list:
    """The calls generate() makes to ``model`` after a prompt cache, recorded as the other records are."""
    import copy

    mask = torch.tensor(prompt_mask)
    ids = torch.randint(3, 60, mask.shape, generator=generator)
    records, state = [], {"ids": ids, "mask": mask}

    def record(module: torch.nn.Module, args: tuple, kwargs: dict, out: object) -> None:
        step_ids = kwargs["input_ids"]
        state["ids"] = torch.cat([state["ids"], step_ids], 1)
        step_mask = kwargs.get("attention_mask")  # generate() passes none where every column is real
        step_mask = step_mask if step_mask is not None else torch.ones(state["ids"].shape, dtype=torch.long)
        records.append({"ids": state["ids"].clone(), "mask": step_mask.clone(), "new": step_ids.shape[1],
                        "logits": out.logits.clone()})  # fmt: skip

    with torch.no_grad():
        prompt = model(input_ids=ids, attention_mask=mask, use_cache=True)
        suffix = torch.randint(3, 60, (mask.shape[0], new), generator=generator)
        handle = model.register_forward_hook(record, with_kwargs=True)
        try:
            model.generate(
                input_ids=torch.cat([ids, suffix], 1),
                attention_mask=torch.cat([mask, torch.ones_like(suffix)], 1),
                past_key_values=copy.deepcopy(prompt.past_key_values),
                max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False, pad_token_id=0,
                **every_logit(model),
            )  # fmt: skip
        finally:
            handle.remove()
    return [{"ids": ids, "mask": mask, "new": ids.shape[1], "logits": prompt.logits.clone()}, *records]


def every_logit(model: torch.nn.Module) -> dict:
    """generate()'s argument for the logits of every new token (it keeps the last one's), by release."""
    import inspect

    parameters = inspect.signature(model.forward).parameters
    name = next((n for n in ("logits_to_keep", "num_logits_to_keep") if n in parameters), None)
    return {name: 0} if name else {}


def packed_call(lengths: list[list[int]], generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """(ids, positions, mask) of rows packing sequences of ``lengths``."""
    width = max(sum(row) for row in lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    positions = torch.zeros_like(ids)
    mask = torch.zeros_like(ids)
    for r, row in enumerate(lengths):
        ids[r, : sum(row)] = torch.randint(3, 60, (sum(row),), generator=generator)
        positions[r, : sum(row)] = torch.cat([torch.arange(n) for n in row])
        mask[r, : sum(row)] = 1
    return ids, positions, mask


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
        for arch, lengths, with_mask, use_cache in PACKED:
            ids, positions, mask = packed_call(lengths, generator)
            given = mask if with_mask else None
            out = built[arch](
                input_ids=ids, position_ids=positions, attention_mask=given, use_cache=use_cache
            )
            records.append({"arch": arch, "ids": ids, "mask": mask, "new": ids.shape[1],
                            "positions": positions, "logits": out.logits.clone()})  # fmt: skip
        for arch, prompt_mask, new in GENERATE:
            records += [{"arch": arch, **r} for r in generate_calls(built[arch], prompt_mask, new, generator)]
    torch.save(records, path)


if __name__ == "__main__":
    run(sys.argv[1])
