"""transformers' flash-attention integration with hfpatch applied, on the CPU: its own unpadding (a 2-D
mask), varlen (sequence lengths) and packed (positions) code, with FlashAttention-2's kernels written in
torch (tests/flash_reference.py). Padded, cached and packed calls, a sliding window past a padded cached
prefix: every real token against its sequence alone, run through the same integration unpadded. The real
kernels run in benchmarks/cuda_checks.py, on a GPU."""

from __future__ import annotations

import pytest
import torch
from packaging.version import Version
from test_packed import SEQUENCES, pack, worst

import hfpatch
from hfpatch.verification.tiny import tiny_config, tiny_model

from conftest import TF, arch_skip_reason, stock
from flash_reference import reference_flash, use_flash
from harness import TOLERANCE, WRONG, random_rows, run_alone, run_padded

pytestmark = pytest.mark.invariant("I1")


@pytest.fixture(autouse=True)
def _flash():
    with reference_flash() as here:
        if not here:
            pytest.skip(f"transformers {TF} keeps no imported flash kernels to stand in for")
        yield


def flash_model(arch: str, **sizes):
    if arch_skip_reason(arch):
        pytest.skip(arch_skip_reason(arch))
    return use_flash(tiny_model(arch, attention="eager", sizes=sizes or None))


def worst_padded(model, rows, chunks, left) -> float:
    got = run_padded(model, rows, chunks, left)
    return max((g - run_alone(model, row)).abs().max().item() for g, row in zip(got, rows))


# (chunks, left) of two rows: one call left-padded; a right-padded cached prefix continued by one token and
# by three; a left-padded prefix continued by a chunk
CASES = {
    "left padding, one call": (((3, 5),), ((True, False),)),
    "right-padded prefix + 1 token": (((3, 5), (1, 1)), ((False, False), (False, False))),
    "right-padded prefix + 3 tokens": (((2, 5), (3, 3)), ((False, False), (False, False))),
    "left-padded prefix + chunk": (((3, 5), (2, 2)), ((True, False), (False, False))),
}


def padding_works(model) -> None:
    """Skip where the release's flash path is wrong with any padding mask for this model, positions aside:
    right padding in one call (no position differs) is off on stock too (4.48-4.57's GPT-2 attention
    calls flash attention non-causal whenever a mask is given)."""
    rows = random_rows([3, 5], seed=50)
    with stock():
        off = worst_padded(model, rows, ((3, 5),), ((False, False),))
    if off > WRONG:
        pytest.skip(f"{type(model).__name__} with flash attention and a padding mask is {off:.2g} off on "
                    f"transformers {TF} with right padding alone (positions aside)")  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_padded_and_cached_calls(arch, case):
    model = flash_model(arch)
    padding_works(model)
    chunks, left = CASES[case]
    rows = random_rows([sum(c[r] for c in chunks) for r in range(2)], seed=51)
    assert worst_padded(model, rows, chunks, left) <= TOLERANCE


def test_stock_is_wrong_there():
    """The cases above on stock: a padded cached prefix continued is wrong for every model, left padding
    for absolute positions (the test would show nothing otherwise)."""
    model = flash_model("gpt2")
    padding_works(model)
    for case in CASES:
        chunks, left = CASES[case]
        rows = random_rows([sum(c[r] for c in chunks) for r in range(2)], seed=51)
        with stock():
            assert worst_padded(model, rows, chunks, left) > WRONG, case


def test_a_sliding_window_past_a_padded_cached_prefix():
    """Mistral with a window of 4, a right-padded prefix longer than it continued: flash attention applies
    the window over the unpadded keys (by position), and hfpatch keeps the cache whole so that the keys
    inside it by position are there (a sliding cache layer keeps the last columns, pads included)."""
    if TF < Version("4.34"):
        pytest.skip(f"no Mistral in transformers {TF}")
    import transformers

    config = tiny_config("mistral", {"sliding_window": 4})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = use_flash(transformers.AutoModelForCausalLM.from_config(config).float().eval())
    rows = random_rows([5, 9], seed=52)
    chunks, left = ((3, 8), (2, 1)), ((False, False), (False, False))
    assert worst_padded(model, rows, chunks, left) <= TOLERANCE
    with stock():
        assert worst_padded(model, rows, chunks, left) > WRONG


LAYOUTS = {
    "no mask": ([list(SEQUENCES)], False),  # transformers' own packed path (by the positions)
    "an all-ones mask": ([list(SEQUENCES)], True),
    "two right-padded rows": ([list(SEQUENCES[:2]), [SEQUENCES[2], (20, 21)]], True),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_packed_rows(arch, layout):
    model = flash_model(arch)
    rows, mask = LAYOUTS[layout]
    if mask:
        padding_works(model)
    kwargs, spans = pack(rows, mask)
    with torch.no_grad():
        logits = model(**kwargs).logits
        assert worst(model, logits, spans) <= TOLERANCE
        if layout == "two right-padded rows":  # flash unpads each row as one sequence (an all-ones mask
            # is dropped: then transformers reads the positions): the packed ones see each other on stock
            with stock():
                assert worst(model, model(**kwargs).logits, spans) > WRONG


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_packed_rows_given_by_their_lengths(arch):
    """The collator's ``return_flash_attn_kwargs=True`` batch (``cu_seq_lens_*``, no positions), which it
    makes for flash attention."""
    collator = getattr(__import__("transformers"), "DataCollatorWithFlattening", None)
    model = flash_model(arch)
    try:
        batch = collator(return_position_ids=False, return_flash_attn_kwargs=True)(
            [{"input_ids": list(seq)} for seq in SEQUENCES]
        )
    except TypeError as exc:
        pytest.skip(f"DataCollatorWithFlattening of transformers {TF}: {exc}")
    batch.pop("labels")
    spans = [(0, sum(len(s) for s in SEQUENCES[:i]), seq) for i, seq in enumerate(SEQUENCES)]
    with torch.no_grad():
        assert worst(model, model(**batch).logits, spans) <= TOLERANCE


def test_status_says_flash():
    import importlib

    importlib.import_module(hfpatch.registry()["llama"].module)
    packed = hfpatch.status()["llama"].packed
    assert packed.startswith("yes") and "flash" in packed, packed


def test_a_pad_inside_a_packed_sequence_warns_its_own_cause(fresh_warnings):
    """Flash attention takes a packed row's sequences by their lengths, which cannot skip a pad inside one:
    left to stock, and the warning says that (not "its layer types take no mask by position")."""
    model = flash_model("llama")
    kwargs, _ = pack([list(SEQUENCES)], True)
    kwargs["attention_mask"][0, 1] = 0  # a pad inside the first sequence, its positions skipping it
    kwargs["position_ids"][0, 1 : len(SEQUENCES[0])] -= 1
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="a pad inside a packed sequence"):
        model(**kwargs)


@pytest.mark.parametrize("autocast", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_packed_and_unpadded_under_autocast(autocast):
    """Mixed precision over fp32 weights: transformers' flash path casts to autocast's dtype; a packed row
    and an unpadded batch, each sequence within the regime's tolerance of itself alone in it."""
    from hfpatch.tolerances import bound

    model = flash_model("llama")
    rows = [list(seq) for seq in SEQUENCES]
    width = max(map(len, rows))
    with torch.no_grad(), torch.autocast("cpu", dtype=autocast):
        with stock():
            want = [model(input_ids=torch.tensor([row])).logits[0].float() for row in rows]
        kwargs, spans = pack([SEQUENCES], True)
        packed = model(**kwargs).logits[0].float()
        hfpatch.apply(unpad=True)
        try:
            ids = torch.tensor([row + [0] * (width - len(row)) for row in rows])
            mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows])
            unpadded = model(input_ids=ids, attention_mask=mask).logits.float()
        finally:
            hfpatch.apply(unpad=False)
    limit = bound(autocast, max(w.abs().max().item() for w in want))
    for (_, start, seq), w, r in zip(spans, want, range(len(rows))):
        assert (packed[start : start + len(seq)] - w).abs().max() <= limit
        assert (unpadded[r, : len(seq)] - w).abs().max() <= limit
