"""Every precision regime runs where stock runs, each sequence within its regime's tolerance of itself
alone in the same regime (hfpatch/tolerances.py): fp16 and bf16 weights, ``torch.autocast`` to fp16 and
bf16 over fp32 weights (how ``Trainer(bf16=True)``, TRL and LoRA train); packed rows, unpadded calls
(``apply(unpad=True)``), padded calls and cached continuations; eager and SDPA; eval and a training step.
The reference is each sequence run alone, unpadded, in one call, on stock transformers, in the regime.
``hfpatch.testing`` and ``verify`` take the regime too."""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from packaging.version import Version

import hfpatch
from hfpatch.tolerances import bound

from conftest import TF, arch_skip_reason
from harness import VOCAB

NO_DROPOUT = {name: 0.0 for name in ("resid_pdrop", "embd_pdrop", "attn_pdrop", "attention_dropout")}
REGIMES = {  # name: (weights' dtype, autocast's dtype)
    "bf16 weights": (torch.bfloat16, None),
    "fp16 weights": (torch.float16, None),
    "autocast bf16": (torch.float32, torch.bfloat16),
    "autocast fp16": (torch.float32, torch.float16),
}
LAYOUTS = ("packed", "unpadded, right", "unpadded, left", "padded, left", "cached, right-padded prefix")
_MODELS: dict = {}


def model_in(arch: str, attention: str, regime: str):
    """A tiny eval-mode model of ``arch`` in the regime's weights (one per combination, reused)."""
    from hfpatch.verification.tiny import tiny_model

    key = (arch, attention, regime)
    if key not in _MODELS:
        weights, _ = REGIMES[regime]
        _MODELS[key] = tiny_model(arch, attention=attention, sizes=NO_DROPOUT).to(weights).eval()
    return _MODELS[key]


def within(regime: str):
    """The regime's autocast around a call (nothing for half weights)."""
    autocast = REGIMES[regime][1]
    return torch.autocast("cpu", dtype=autocast) if autocast is not None else contextlib.nullcontext()


def alone(model, regime: str, row: list[int]) -> torch.Tensor:
    with torch.no_grad(), within(regime), hfpatch.unpatched():
        return model(input_ids=torch.tensor([row])).logits[0].float()


def padded(rows: list[list[int]], left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = [[0] * (width - len(r)) + r if left else r + [0] * (width - len(r)) for r in rows]
    mask = [
        [0] * (width - len(r)) + [1] * len(r) if left else [1] * len(r) + [0] * (width - len(r)) for r in rows
    ]
    return torch.tensor(ids), torch.tensor(mask)


@contextlib.contextmanager
def unpadding(on: bool):
    if on:
        hfpatch.apply(unpad=True)
    try:
        yield
    finally:
        if on:
            hfpatch.apply(unpad=False)


def run(model, regime: str, layout: str, rows: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(got, want) per sequence: its real tokens' logits in the layout, and the sequence alone."""
    with torch.no_grad(), within(regime):
        if layout == "packed":
            ids = torch.tensor([sum(rows, [])])
            positions = torch.cat([torch.arange(len(r)) for r in rows])[None]
            out = model(input_ids=ids, position_ids=positions).logits[0].float()
            got = list(out.split([len(r) for r in rows]))
        elif layout.startswith(("unpadded", "padded")):
            ids, mask = padded(rows, layout.endswith("left"))
            with unpadding(layout.startswith("unpadded")):
                out = model(input_ids=ids, attention_mask=mask).logits.float()
            got = [out[r][mask[r] != 0] for r in range(len(rows))]
        else:  # a right-padded prefix cached, continued by two tokens
            ids, mask = padded([r[:-1] or r for r in rows], False)
            first = model(input_ids=ids, attention_mask=mask, use_cache=True)
            more = torch.tensor([[VOCAB - 1, VOCAB - 2]] * len(rows))
            mask = torch.cat([mask, torch.ones(len(rows), 2, dtype=torch.long)], 1)
            cache = getattr(first, "past_key_values", None) or getattr(first, "cache", None)
            out = model(input_ids=more, attention_mask=mask, past_key_values=cache).logits.float()
            rows = [(r[:-1] or r) + [VOCAB - 1, VOCAB - 2] for r in rows]
            return [(out[i], alone(model, regime, row)[-2:]) for i, row in enumerate(rows)]
    return [(g, alone(model, regime, row)) for g, row in zip(got, rows)]


def runs_here(arch: str, layout: str) -> bool:
    """Whether this release runs ``layout`` for ``arch`` with hfpatch (packed rows kept; a cache object)."""
    if layout.startswith(("packed", "unpadded")) and not hfpatch.status()[arch].packed.startswith("yes"):
        return False
    return not layout.startswith("cached") or TF >= Version("4.36")


@pytest.fixture(params=["llama", "gpt2"])
def arch(request) -> str:
    if arch_skip_reason(request.param):
        pytest.skip(arch_skip_reason(request.param))
    return request.param


@settings(max_examples=15, deadline=None)
@given(
    regime=st.sampled_from(list(REGIMES)),
    layout=st.sampled_from(LAYOUTS),
    attention=st.sampled_from(["eager", "sdpa"]),
    lengths=st.lists(st.integers(1, 9), min_size=2, max_size=4),
)
def test_each_sequence_within_its_regimes_tolerance(arch, regime, layout, attention, lengths):
    model = model_in(arch, attention, regime)
    assume(runs_here(arch, layout))
    generator = torch.Generator().manual_seed(sum(lengths))
    rows = [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in lengths]
    pairs = run(model, regime, layout, rows)
    scale = max(want.abs().max().item() for _, want in pairs)
    worst = max((got - want).abs().max().item() for got, want in pairs)
    assert worst <= bound(REGIMES[regime][1] or REGIMES[regime][0], scale), (regime, layout, worst, scale)


@pytest.mark.slow
@pytest.mark.compile
@pytest.mark.parametrize("regime", ["autocast bf16", "autocast fp16"])
def test_a_compiled_unpadded_call_under_autocast(regime):
    """``torch.compile(model)`` under ``apply(unpad=True)`` and autocast over fp32 weights (Llama, SDPA,
    where its compiled packed rows run by sequence): the call runs on its real tokens (a pad's logits are
    zeros), each sequence within its regime's tolerance of itself alone in the regime."""
    if TF < Version("4.53") or arch_skip_reason("llama"):
        pytest.skip(f"Llama's compiled packed rows run SDPA by sequence from 4.53 (installed {TF})")
    model = model_in("llama", "sdpa", regime)
    rows = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16], [17]]
    ids, mask = padded(rows, False)
    torch._dynamo.reset()
    try:
        with torch.no_grad(), within(regime), unpadding(True):
            out = torch.compile(model, backend="eager")(input_ids=ids, attention_mask=mask).logits.float()
    finally:
        torch._dynamo.reset()
    assert bool((out[mask == 0] == 0).all())
    pairs = [(out[r][mask[r] != 0], alone(model, regime, row)) for r, row in enumerate(rows)]
    scale = max(want.abs().max().item() for _, want in pairs)
    worst = max((got - want).abs().max().item() for got, want in pairs)
    assert worst <= bound(REGIMES[regime][1], scale), (regime, worst, scale)


@pytest.mark.parametrize("layout", ["packed", "unpadded"])
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("regime", ["autocast bf16", "autocast fp16"])
def test_a_training_step_under_autocast(regime, attention, layout):
    """A training step under autocast over fp32 weights: a packed row's (or an unpadded call's) loss and
    gradients are the padded batch's, in the same regime."""
    from hfpatch.verification.tiny import tiny_model

    if arch_skip_reason("llama") or not runs_here("llama", layout):
        pytest.skip(f"llama's packed rows are not kept in transformers {TF}")
    torch.manual_seed(0)
    model = tiny_model("llama", attention=attention, sizes=NO_DROPOUT).train()
    rows = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [14, 15, 16, 17]]
    ids, mask = padded(rows, False)
    labels = ids.masked_fill(mask == 0, -100)

    def step(**kwargs):
        model.zero_grad(set_to_none=True)
        with within(regime):
            loss = model(**kwargs).loss
        loss.backward()
        return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want, want_grads = step(input_ids=ids, attention_mask=mask, labels=labels)
    if layout == "packed":
        packed = {
            "input_ids": torch.tensor([sum(rows, [])]),
            "position_ids": torch.cat([torch.arange(len(r)) for r in rows])[None],
            "labels": torch.tensor([sum(([-100] + r[1:] for r in rows), [])]),
        }
        got, got_grads = step(**packed)
    else:
        with unpadding(True):
            got, got_grads = step(input_ids=ids, attention_mask=mask, labels=labels)
    share = bound(REGIMES[regime][1])
    assert abs(got - want) <= share * max(1.0, abs(want))
    for name, g in want_grads.items():
        assert ((got_grads[name] - g).norm() / g.norm().clamp(min=1e-12)).item() <= 10 * share, name


@pytest.mark.parametrize("regime", ["autocast bf16", "bf16 weights"])
def test_the_oracle_and_verify_take_the_regime(regime):
    """``hfpatch.testing`` and ``verify`` check a regime against each row alone in it: exact with hfpatch,
    stock wrong beyond the regime's tolerance; a dtype that is no half precision is a ValueError."""
    from hfpatch.testing import assert_padding_invariant

    if arch_skip_reason("llama"):
        pytest.skip(arch_skip_reason("llama"))
    weights, autocast = REGIMES[regime]
    model = model_in("llama", "sdpa", regime)
    families = ["padding", "cached"]
    report = assert_padding_invariant(model, autocast=autocast, families=families)
    assert report.dtype == str(autocast or weights).removeprefix("torch.")
    with hfpatch.unpatched(), pytest.raises(AssertionError):
        assert_padding_invariant(model, autocast=autocast, families=families)
    # (static=False: a StaticCache under autocast raises on stock alike on some releases, 4.57: its fp32
    # buffers take bf16 keys)
    verified = hfpatch.verify("llama", static=False, dtype=weights, autocast=autocast)
    assert verified.ok and verified.stock_wrong, str(verified)
    with pytest.raises(ValueError, match="autocast"):
        assert_padding_invariant(model, autocast=torch.float32)
    with pytest.raises(ValueError, match="dtype"):
        hfpatch.verify(model, dtype=torch.bfloat16)
