"""CUDA graphs check: greedy decoding with a StaticCache and implicit positions (hfpatch derives them
from the mask) under torch.compile(mode="reduce-overhead") gives the same tokens as eager.

    python benchmarks/cuda_graphs.py        # needs a CUDA GPU; exits 2 without one

transformers PR #29221 was closed because positions computed inside ``forward`` gave wrong
generations under CUDA graphs; this is the check that hfpatch does not repeat that. Prints one line
per architecture and exits 1 on a mismatch.
"""

from __future__ import annotations

import sys

import torch

import hfpatch
from hfpatch.tiny import VOCAB, tiny_model
from hfpatch.verification import cache_name, new_static_cache


def greedy(
    model, forward, prompt: torch.Tensor, mask: torch.Tensor, steps: int, capacity: int
) -> torch.Tensor:
    """Prefill eagerly, then ``steps`` single-token calls of ``forward`` with a full-length mask."""
    batch, length = prompt.shape
    cache = new_static_cache(model, batch, capacity, device="cuda")
    full = torch.zeros(batch, capacity, dtype=torch.long, device="cuda")
    full[:, :length] = mask
    name = cache_name(model)
    with torch.no_grad():
        out = model(input_ids=prompt, attention_mask=full, use_cache=True, **{name: cache})
        tokens = [out.logits[:, -1:].argmax(-1)]
        for i in range(steps):
            full[:, length + i] = 1
            out = forward(input_ids=tokens[-1], attention_mask=full.clone(), use_cache=True, **{name: cache})
            tokens.append(out.logits[:, -1:].argmax(-1).clone())
    return torch.cat(tokens, dim=1)


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: this check needs a GPU")
        return 2
    hfpatch.apply()
    failed = False
    for arch in ("gpt2", "llama", "gemma"):
        model = tiny_model(arch).cuda()
        prompt = torch.randint(1, VOCAB, (3, 10), device="cuda")
        mask = torch.ones(3, 10, dtype=torch.long, device="cuda")
        mask[0, :4] = 0  # left padding
        mask[1, :2] = 0
        eager = greedy(model, model, prompt, mask, steps=24, capacity=48)
        torch._dynamo.reset()
        compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
        graphs = greedy(model, compiled, prompt, mask, steps=24, capacity=48)
        same = torch.equal(eager, graphs)
        failed |= not same
        verdict = "==" if same else "!="
        print(f"{arch}: reduce-overhead tokens {verdict} eager ({eager.shape[1]} tokens x 3 rows)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
