"""Sliding windows and chunked attention decided by position (hfpatch/windows.py): a padded cached
prefix longer than the window, continued, gives each row its own result, past the window too: the
issue's case (a right-padded prefix of 148 tokens, 10 of them pads in the shorter row, window 128,
continued by 1 and by 3 tokens), with the model's own cache and with a StaticCache. The reference is
each row run alone, unpadded, in one call, on stock transformers."""

from __future__ import annotations

import pytest
import torch

from hfpatch.verification.tiny import tiny_config

from conftest import TF, arch_skip_reason, static_cache_skip_reason, stock
from harness import (
    TOLERANCE,
    WRONG,
    cache_kwarg,
    max_diff,
    output_cache,
    random_rows,
    run_padded,
    static_cache,
    windowed_model,
)

WINDOW = 128
# model type: the config fields that give it a window of WINDOW tokens (and its kind of layers)
WINDOWED = {
    "mistral": {"sliding_window": WINDOW},
    "gemma2": {"sliding_window": WINDOW},
    "gpt_oss": {"sliding_window": WINDOW},
    "gemma3_text": {"sliding_window": WINDOW},
    "cohere2": {"sliding_window": WINDOW},
    "olmo3": {"sliding_window": WINDOW},
    "exaone4": {"sliding_window": WINDOW},
    "starcoder2": {"sliding_window": WINDOW},
    "phi3": {"sliding_window": WINDOW},
    "granite_swa": {"sliding_window": WINDOW},
    "llama4_text": {"attention_chunk_size": WINDOW},
}
QUICK = ("mistral", "gemma2")
PARAMS = [pytest.param(t, marks=() if t in QUICK else pytest.mark.slow) for t in WINDOWED]
CASES = {  # chunks, left: a right-padded prefix of 148 and 138 tokens, then 1 or 3 more tokens a row
    "prefix past the window + 1": (((148, 138), (1, 1)), ((False, False), (False, False))),
    "prefix past the window + 3": (((148, 138), (3, 3)), ((False, False), (True, False))),
}


def _model(model_type: str, attention: str):
    reason = arch_skip_reason(model_type)
    if reason:
        pytest.skip(reason)
    config = tiny_config(model_type)
    for name, value in WINDOWED[model_type].items():
        setattr(config, name, value)
    config.max_position_embeddings = 512
    return windowed_model(model_type, config, attention)


@pytest.mark.parametrize("cache", ["model's own", "StaticCache"])
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("model_type", PARAMS)
def test_holes_inside_the_window(model_type, attention, cache):
    model = _model(model_type, attention)
    if cache == "StaticCache" and static_cache_skip_reason(model):
        pytest.skip(static_cache_skip_reason(model))
    stock_errors = []
    for name, (chunks, left) in CASES.items():
        rows = random_rows([sum(c[r] for c in chunks) for r in range(2)], seed=len(name))
        make = (lambda: static_cache(model, 2, 160)) if cache == "StaticCache" else (lambda: None)
        got = run_padded(model, rows, chunks, left, cache=make())
        assert max_diff(model, rows, got) <= TOLERANCE, name
        with stock():
            try:
                stock_errors.append(
                    max_diff(model, rows, run_padded(model, rows, chunks, left, cache=make()))
                )
            except Exception:  # noqa: BLE001 - stock cannot run some of these (a full static sliding layer)
                stock_errors.append(float("inf"))
    assert max(stock_errors) > WRONG, "stock transformers is right: the window does not act here"


@pytest.mark.compile
@pytest.mark.parametrize("cache", ["model's own", "StaticCache"])
def test_compiles_with_fullgraph(cache):
    """A decode loop past the window, compiled with fullgraph=True: no graph break of hfpatch's own
    (the masks are tensor ops; the layer swap and the cache's creation are Python on object types),
    the same tokens as eager, and exact against each row alone."""
    model = _model("mistral", "sdpa")
    if cache == "StaticCache" and static_cache_skip_reason(model):
        pytest.skip(static_cache_skip_reason(model))
    a, b = random_rows([140, 132], seed=11)
    prompt = torch.tensor([a, b + [0] * 8])
    mask = torch.tensor([[1] * 140, [1] * 132 + [0] * 8])  # right-padded: a hole of 8 once continued

    def decode(forward):
        width = 160 if cache == "StaticCache" else None
        state = static_cache(model, 2, 160) if width else None
        name = cache_kwarg(model)
        full = mask if width is None else torch.cat([mask, mask.new_zeros(2, width - 140)], 1)
        with torch.no_grad():
            out = model(input_ids=prompt, attention_mask=full, use_cache=True, **{name: state})
            state = output_cache(out)
            if isinstance(state, tuple):  # fed back, transformers' own deprecation warning breaks the graph
                pytest.skip(f"the model's own cache is a legacy tuple in transformers {TF}")
            tokens, logits, grown = [out.logits[:, -1:].argmax(-1)], [], mask
            for _ in range(4):
                grown = torch.cat([grown, grown.new_ones(2, 1)], 1)
                call_mask = (
                    grown
                    if width is None
                    else torch.cat([grown, grown.new_zeros(2, width - grown.shape[1])], 1)
                )
                out = forward(input_ids=tokens[-1], attention_mask=call_mask, use_cache=True, **{name: state})
                state = output_cache(out)
                logits.append(out.logits[:, -1])
                tokens.append(out.logits[:, -1:].argmax(-1))
        return torch.cat(tokens, 1), torch.stack(logits, 1)

    eager_tokens, eager_logits = decode(model)
    torch._dynamo.reset()
    try:
        compiled_tokens, compiled_logits = decode(torch.compile(model, fullgraph=True, backend="eager"))
    finally:
        torch._dynamo.reset()
    assert torch.equal(compiled_tokens, eager_tokens)
    assert (compiled_logits - eager_logits).abs().max().item() <= TOLERANCE
    row_b = b + eager_tokens[1, :4].tolist()  # row b alone, unpadded, with the tokens it was given
    with torch.no_grad(), stock():
        alone = model(input_ids=torch.tensor([row_b])).logits[0, -4:]
    assert (compiled_logits[1] - alone).abs().max().item() <= TOLERANCE
