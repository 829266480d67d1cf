"""Vision-language wrappers, text only: stock transformers is wrong, hfpatch is exact.

Every multimodal adapter (hfpatch/adapters/wrappers.py) and its aliases on a tiny random
image-text-to-text model, eager and SDPA: a right-padded prefix continued from the cache by one token,
and a left-padded prompt in one call. The reference is written here by hand: each row run alone,
unpadded, in one call, on stock transformers (PaliGemma, a prefix LM whose masked prefill attends the
prompt both ways on 4.57-5.5: each row alone through the same cached calls, with a mask of ones).
Then calls with an image (PaliGemma, LLaVA) or audio (Qwen2-Audio, through Qwen2Model) in a padded
cached batch, and ``hfpatch.verify`` on the text path of a few image-text-to-text models.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import pytest
import torch
from packaging.version import Version
from probes import Probe, both_sides, exact_where_run

import hfpatch
from compat.vocabulary import OUTSIDE
from hfpatch.support import wrong_with
from hfpatch.verification.tiny import PAD, tiny_multimodal, tiny_seq2seq

from conftest import REGISTRY, TF, require_covered, stock
from harness import TOLERANCE, WRONG, cache_kwarg, output_cache

MULTIMODAL = [name for name, adapter in REGISTRY.items() if adapter.family.multimodal]
CASES = [(name, alias) for name in MULTIMODAL for alias in (name, *REGISTRY[name].aliases)]
QUICK = {("paligemma", "eager"), ("qwen2_vl", "sdpa"), ("chameleon", "eager")}  # wrapper, text model, plain
PREFIX_LM = {"paligemma"}  # its reference runs the same cached calls, one row at a time
# measured: 5.0-5.1's Qwen-VL (and GLM-4V, PaddleOCR-VL) wrappers number a text-only cached call from its
# mask themselves (stock right on the padded prefix continued; hfpatch must stay exact), before and after
# they count it without the mask
STOCK_RIGHT_ON_PREFIX = (
    {"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v", "paddleocr_vl"},
    Version("5.0"),
    Version("5.2"),
)  # fmt: skip
A, B = [11, 12, 13, 14, 15], [21, 22, 23]


def _params() -> list[Any]:
    return [
        pytest.param(
            name,
            model_type,
            attention,
            id=f"{model_type}-{attention}",
            marks=() if (model_type, attention) in QUICK else pytest.mark.slow,
        )  # fmt: skip
        for name, model_type in CASES
        for attention in ("eager", "sdpa")
    ]


_models: dict[tuple[str, str], Any] = {}


def _model(name: str, model_type: str, attention: str, probe: Optional[Probe] = None) -> Any:
    require_covered(name, probe)
    since = dict(REGISTRY[name].alias_since).get(model_type)
    if since is not None and TF < Version(since):
        if probe is not None:
            probe.found(OUTSIDE)
        pytest.skip(f"{model_type} is covered from {since}; installed {TF}")
    declared = wrong_with(REGISTRY[name], attention, TF)
    if declared:
        pytest.skip(f"{model_type} with {attention}: declared ({declared})")
    if (model_type, attention) not in _models:
        _models[model_type, attention] = tiny_multimodal(model_type, attention=attention)
    return _models[model_type, attention]


def _alone(model: Any, row: list[int], split: int) -> torch.Tensor:
    """One row's logits, unpadded, on stock: one call (or, for a prefix LM, the same two cached calls)."""
    with torch.no_grad(), hfpatch.unpatched():
        if model.config.model_type not in PREFIX_LM:
            return model(input_ids=torch.tensor([row])).logits[0]
        ids = torch.tensor([row[:split]])
        first = model(input_ids=ids, attention_mask=torch.ones_like(ids))
        mask = torch.ones(1, len(row), dtype=torch.long)
        rest = torch.tensor([row[split:]])
        second = model(input_ids=rest, attention_mask=mask, **{cache_kwarg(model): output_cache(first)})
        return torch.cat([first.logits[0], second.logits[0]])


def _prefix_error(model: Any) -> float:
    """A right-padded prefix (A: 4 tokens, B: 2 and 2 pads), then one token each from the cache."""
    ids, mask = torch.tensor([A[:4], B[:2] + [PAD, PAD]]), torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    with torch.no_grad():
        first = model(input_ids=ids, attention_mask=mask)
        mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
        step = torch.tensor([[A[4]], [B[2]]])
        second = model(input_ids=step, attention_mask=mask, **{cache_kwarg(model): output_cache(first)})
    rows = [
        torch.cat([first.logits[0], second.logits[0]]),
        torch.cat([first.logits[1, :2], second.logits[1]]),
    ]
    pairs = zip((A, B), (4, 2), rows)
    return max((_alone(model, row, split) - got).abs().max().item() for row, split, got in pairs)


def _left_padded_error(model: Any) -> float:
    ids, mask = torch.tensor([A, [PAD, PAD, *B]]), torch.tensor([[1] * 5, [0, 0, 1, 1, 1]])
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask).logits
    errors = [_alone(model, A, 5) - out[0], _alone(model, B, 3) - out[1, 2:]]
    return max(error.abs().max().item() for error in errors)


@pytest.mark.parametrize("name, model_type, attention", _params())
def test_padded_prefix_continued_equals_each_row_alone(name, model_type, attention, probe):
    probe.of(model_type, attention)
    model = _model(name, model_type, attention, probe)
    patched, on_stock = both_sides(probe, lambda: _prefix_error(model), stock_raises=(RuntimeError,))
    types, first, past = STOCK_RIGHT_ON_PREFIX
    stock_wrong = not (name in types and first <= Version(TF.base_version) < past)
    probe.judge(patched, on_stock, stock_wrong_expected=stock_wrong)
    assert patched <= TOLERANCE, f"{model_type} ({attention}): hfpatch {patched:.2g}, stock {on_stock:.2g}"
    assert on_stock > WRONG or not stock_wrong, (
        f"{model_type} ({attention}): stock is right ({on_stock:.2g}): the entry is stale"
    )


@pytest.mark.parametrize("name, model_type, attention", _params())
def test_left_padded_prompt_equals_each_row_alone(name, model_type, attention, probe):
    """Rotary: a uniform left shift cancels, so stock is right too; hfpatch must stay exact."""
    probe.of(model_type, attention)
    if model_type in PREFIX_LM:
        pytest.skip("a prefix LM: a one-call prompt is the prefix, attended both ways")
    model = _model(name, model_type, attention, probe)
    patched, on_stock = both_sides(probe, lambda: _left_padded_error(model))
    probe.judge(patched, on_stock, stock_wrong_expected=False)
    assert patched <= TOLERANCE, f"{model_type} ({attention}): hfpatch {patched:.2g}"


@pytest.mark.parametrize("model_type", ["paligemma", "qwen2_vl"])  # the wrapper's forward, the text model
def test_explicit_positions_and_no_mask_are_stock(model_type):
    """The caller's position ids are forwarded unchanged, and a call without a mask is stock: bit for bit."""
    name = model_type
    model = _model(name, model_type, "eager")
    ids = torch.tensor([A[:3], B])
    positions = torch.tensor([[3, 4, 5], [0, 1, 2]])
    with torch.no_grad():
        got = [
            model(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=positions).logits,
            model(input_ids=ids).logits,
        ]
        with stock():
            want = [
                model(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=positions).logits,
                model(input_ids=ids).logits,
            ]
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def _prefill_continued_error(model: Any, rows: list[list[int]], inputs: dict[str, torch.Tensor]) -> float:
    """Rows with their own image or audio (``inputs``, one per row) and text, right-padded, then one token
    each from the cache: the largest difference from each row alone through the same two calls (its own
    inputs, a mask of ones), on stock."""
    kw = cache_kwarg(model)
    width = max(len(row) - 1 for row in rows)
    ids = torch.tensor([row[:-1] + [PAD] * (width + 1 - len(row)) for row in rows])
    mask = torch.tensor([[1] * (len(row) - 1) + [0] * (width + 1 - len(row)) for row in rows])
    with torch.no_grad():
        first = model(input_ids=ids, attention_mask=mask, **inputs)
        mask = torch.cat([mask, torch.ones(len(rows), 1, dtype=mask.dtype)], 1)
        step = torch.tensor([row[-1:] for row in rows])
        second = model(input_ids=step, attention_mask=mask, **{kw: output_cache(first)})
    errors = []
    for r, row in enumerate(rows):
        got = torch.cat([first.logits[r, : len(row) - 1], second.logits[r]])
        with torch.no_grad(), hfpatch.unpatched():
            own = {name: value[r : r + 1] for name, value in inputs.items()}
            alone_ids = torch.tensor([row[:-1]])
            alone = model(input_ids=alone_ids, attention_mask=torch.ones_like(alone_ids), **own)
            full = torch.ones(1, len(row), dtype=torch.long)
            last = model(input_ids=torch.tensor([row[-1:]]), attention_mask=full, **{kw: output_cache(alone)})
        errors.append((torch.cat([alone.logits[0], last.logits[0]]) - got).abs().max().item())
    return max(errors)


@pytest.mark.parametrize(
    "model_type", ["paligemma", pytest.param("llava", marks=pytest.mark.slow)]
)  # the wrapper's own positions, the language model's
def test_image_prefill_in_a_padded_batch_continued_from_the_cache(model_type, probe):
    """Rows with an image each (4 image tokens first: an image of 28 x 28 pixels in patches of 14),
    right-padded, then one token each from the cache: each row equals itself alone through the same two
    calls (its image, a mask of ones)."""
    probe.of(model_type, "eager")
    if model_type == "paligemma":
        model = _model("paligemma", "paligemma", "eager", probe)
    elif TF < Version("4.57"):  # the tiny model's builder (AutoModelForImageTextToText) and overrides
        pytest.skip(f"the image test builds LLaVA from 4.57 (installed {TF})")
    else:
        model = tiny_multimodal("llava", attention="eager")
    pixels = torch.randn(2, 3, 28, 28, generator=torch.Generator().manual_seed(1))
    image = getattr(model.config, "image_token_id", None) or model.config.image_token_index
    rows = [[image] * 4 + [11, 12, 13, 14], [image] * 4 + [21]]
    inputs = {"pixel_values": pixels}
    patched, on_stock = both_sides(probe, lambda: _prefill_continued_error(model, rows, inputs))
    probe.judge(patched, on_stock, stock_wrong_expected=True)
    assert patched <= TOLERANCE, f"{model_type} with an image: hfpatch {patched:.2g}, stock {on_stock:.2g}"
    assert on_stock > WRONG, f"{model_type} with an image: stock is right ({on_stock:.2g})"


AUDIO = 90  # the tiny Qwen2-Audio's audio token: 8 per 32 frames of features, 6 per 24


def test_audio_prefill_in_a_padded_batch_continued_from_the_cache():
    """Qwen2-Audio (through Qwen2Model): rows with their own audio (32 and 24 frames of features: 8 and 6
    audio tokens) and text, right-padded, then one token each from the cache: each row equals itself
    alone through the same two calls (its audio, a mask of ones)."""
    require_covered("qwen2")
    if TF < Version("4.57"):  # the tiny model's builder and sizes
        pytest.skip(f"the audio test builds Qwen2-Audio from 4.57 (installed {TF})")
    model = tiny_seq2seq("qwen2_audio", attention="eager", audio_token_id=AUDIO)
    features = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1))
    frames = torch.tensor([[1] * 32, [1] * 24 + [0] * 8])
    rows = [[AUDIO] * 8 + [11, 12, 13, 14, 15], [AUDIO] * 6 + [21, 22]]
    inputs = {"input_features": features, "feature_attention_mask": frames}
    patched = _prefill_continued_error(model, rows, inputs)
    with stock():
        on_stock = _prefill_continued_error(model, rows, inputs)
    assert patched <= TOLERANCE, f"qwen2_audio with audio: hfpatch {patched:.2g}, stock {on_stock:.2g}"
    assert on_stock > WRONG, f"qwen2_audio with audio: stock is right ({on_stock:.2g})"


@pytest.mark.parametrize(
    "model_type, adapter", [("paligemma", "paligemma"), ("qwen2_vl", "qwen2_vl"), ("llava", "llama")]
)
def test_verify_runs_the_text_scenarios(model_type, adapter):
    """``hfpatch.verify`` on an image-text-to-text model: the decoder-only scenarios on its text path (a
    wrapper patched itself, a text model, a wrapper through its language model): exact with hfpatch,
    wrong on stock. PaliGemma where it is a prefix LM: each row alone through the same cached calls."""
    require_covered(adapter)
    if model_type in REGISTRY:
        model = _model(model_type, model_type, "eager")
    elif TF < Version("4.57"):  # the tiny model's builder (AutoModelForImageTextToText) and overrides
        pytest.skip(f"the test builds {model_type} from 4.57 (installed {TF})")
    else:
        model = tiny_multimodal(model_type, attention="eager")
    result = hfpatch.verify(model)
    assert exact_where_run(result) and result.stock_wrong, str(result)
    assert len(result.rows) >= 4, str(result)
    if model_type == "llava":
        assert "llava runs LlamaModel, patched by the 'llama' adapter" in result.notes, str(result)


SEQUENCES = ([5, 6, 7, 8, 9, 10], [11, 12, 13], [14, 15, 16, 17, 18])
# the forms a text-only packed row's positions take: 2-D (DataCollatorWithFlattening, TRL's padding_free),
# the multimodal rope rows [t; h; w] and [text; t; h; w] (all equal for text), with or without a mask
POSITION_FORMS = ("2-D", "[t; h; w]", "[text; t; h; w]")


def _packed_positions(form: str) -> torch.Tensor:
    positions = torch.tensor([[i for seq in SEQUENCES for i in range(len(seq))]])
    rows = {"2-D": 0, "[t; h; w]": 3, "[text; t; h; w]": 4}[form]
    return positions if not rows else positions[None].expand(rows, 1, -1).contiguous()


@pytest.mark.parametrize("model_type", ["qwen2_vl", pytest.param("qwen3_vl", marks=pytest.mark.slow)])
def test_text_only_packed_rows_of_the_qwen_vl_family(model_type, probe):
    """Several text sequences packed in a row (no image), in each form the positions come in, with and
    without an all-ones mask: each sequence gets its own logits, and a packed training step (train mode,
    dropout off) its own loss and gradients; stock lets the sequences see each other."""
    probe.of(model_type, "sdpa")
    model = _qwen_vl_model(model_type, probe)
    ids = torch.tensor([[t for seq in SEQUENCES for t in seq]])
    spans = [(sum(len(s) for s in SEQUENCES[:i]), seq) for i, seq in enumerate(SEQUENCES)]
    with torch.no_grad(), hfpatch.unpatched():
        alone = [model(input_ids=torch.tensor([seq])).logits[0] for seq in SEQUENCES]
    taken = []  # the forms the release's text model takes (4.52-4.55's: not [text; t; h; w])
    for form in POSITION_FORMS:
        for mask in (None, torch.ones_like(ids)):
            kwargs = {"input_ids": ids, "position_ids": _packed_positions(form)}
            if mask is not None:
                kwargs["attention_mask"] = mask
            with torch.no_grad():
                with hfpatch.unpatched():
                    try:
                        wrong = model(**kwargs).logits[0]
                    except RuntimeError:  # (a form this release's text model does not take)
                        break
                got = model(**kwargs).logits[0]
            worst = max((got[s : s + len(seq)] - a).abs().max().item() for (s, seq), a in zip(spans, alone))
            off = max((wrong[s : s + len(seq)] - a).abs().max().item() for (s, seq), a in zip(spans, alone))
            assert worst <= TOLERANCE and off > WRONG, (form, mask is not None, worst, off)
        else:
            taken.append(form)
    assert "2-D" in taken and hfpatch.status()[model_type].packed.startswith("yes")
    # a training step, in the last form taken: the loss and gradients of the sequences alone
    labels = ids.clone()
    labels[_packed_positions("2-D") == 0] = -100
    total = sum(len(seq) - 1 for seq in SEQUENCES)
    packed = _gradients(
        model,
        lambda: _summed_loss(model(input_ids=ids, position_ids=_packed_positions(taken[-1])), labels) / total,
    )

    def alone_loss() -> torch.Tensor:
        rows = [torch.tensor([seq]) for seq in SEQUENCES]
        return sum(_summed_loss(model(input_ids=row), row) for row in rows) / total

    with hfpatch.unpatched():
        want = _gradients(model, alone_loss)
    assert max(((packed[k] - want[k]).norm() / want[k].norm().clamp(min=1e-12)).item() for k in want) <= 1e-4


def _summed_loss(out: Any, labels: torch.Tensor) -> torch.Tensor:
    """The next-token cross entropy of a causal LM's output, summed over the targets (not -100), by hand
    (4.52-4.55's Qwen-VL wrappers fail given ``labels``: their config has no ``vocab_size``)."""
    logits = out.logits[:, :-1]
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100, reduction="sum"
    )


def _gradients(model: Any, loss: Any) -> dict:
    """Every parameter's gradient of ``loss()``, in train mode (the tiny models have no dropout)."""
    model.train()
    try:
        model.zero_grad(set_to_none=True)
        loss().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    finally:
        model.eval()
        model.zero_grad(set_to_none=True)


# the Qwen-VL family with images: one image of 4 x 4 patches (merged 2 x 2: 4 tokens, id 96) per sequence,
# framed by its start (95) and end (94) tokens; a patch's pixels: 3 channels x 2 x 2
IMAGE, V_START, V_END = 96, 95, 94
GRID = torch.tensor([[1, 4, 4]])
QWEN_VL = ["qwen2_vl", pytest.param("qwen2_5_vl", marks=pytest.mark.slow), "qwen3_vl"]


def _pixels(seed: int) -> torch.Tensor:
    return torch.randn(16, 3 * 2 * 2, generator=torch.Generator().manual_seed(seed))


def _image_inputs(model: Any, ids: torch.Tensor, images: int, seeds: list[int]) -> dict:
    """The image arguments of a call whose ``ids`` hold ``images`` images (their pixels by seed); the
    multimodal token types where the release's wrapper takes them (5.x)."""
    inputs = {
        "pixel_values": torch.cat([_pixels(s) for s in seeds]),
        "image_grid_thw": GRID.repeat(images, 1),
    }
    if "mm_token_type_ids" in inspect.signature(type(model).forward).parameters:
        inputs["mm_token_type_ids"] = (ids == IMAGE).long()
    return inputs


def _qwen_vl_model(model_type: str, probe: Probe) -> Any:
    if model_type not in REGISTRY:
        pytest.skip(f"{model_type} is not patched in transformers {TF}")
    return _model(model_type, model_type, "sdpa", probe)


def _alone_with_image(model: Any, row: list[int], seed: int) -> tuple[torch.Tensor, Any]:
    """A sequence with its image run alone, unpadded, in one call, on stock: its logits, and the positions
    the wrapper hands its text model (its own multimodal rope index)."""
    seen = []
    text = type(model.model.language_model)
    forward = text.forward

    def spy(self: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs.get("position_ids"))
        return forward(self, *args, **kwargs)

    ids = torch.tensor([row])
    with torch.no_grad(), hfpatch.unpatched():
        text.forward = spy
        try:
            logits = model(input_ids=ids, **_image_inputs(model, ids, 1, [seed])).logits[0]
        finally:
            text.forward = forward
    return logits, seen[0]


@pytest.mark.parametrize("model_type", QWEN_VL)
def test_image_prefill_of_the_qwen_vl_family_continued_by_plain_calls(model_type, probe):
    """Two rows with an image each, right-padded, continued from the cache by plain calls (no positions,
    a pad among the new tokens of one): each real token's logits equal its row's run alone with its image
    in one call. Stock fails (its deltas meet a mask of past and new tokens) or counts the pad."""
    probe.of(model_type, "sdpa")
    model = _qwen_vl_model(model_type, probe)
    rows = [[5, V_START, *[IMAGE] * 4, V_END, 7, 8], [V_START, *[IMAGE] * 4, V_END, 12]]
    later = [[[9, 10], [13, PAD]], [[11], [14]]]  # two cached calls; row 1's second token a pad
    full = [rows[0] + [9, 10, 11], rows[1] + [13, 14]]
    want = [_alone_with_image(model, row, seed)[0] for seed, row in enumerate(full)]

    def run() -> float:
        width = max(len(row) for row in rows)
        ids = torch.tensor([row + [PAD] * (width - len(row)) for row in rows])
        mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows])
        got = [[], []]
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, **_image_inputs(model, ids, 2, [0, 1]))
            for r, row in enumerate(rows):
                got[r].append(out.logits[r, : len(row)])
            for step in later:
                new = torch.tensor(step)
                new_mask = (new != PAD).long()
                mask = torch.cat([mask, new_mask], 1)
                out = model(input_ids=new, attention_mask=mask, **{cache_kwarg(model): output_cache(out)})
                for r in range(2):
                    got[r].append(out.logits[r][new_mask[r].bool()])
        return max((torch.cat(g) - w).abs().max().item() for g, w in zip(got, want))

    patched, on_stock = both_sides(probe, run, stock_raises=(RuntimeError,))
    probe.judge(patched, on_stock, stock_wrong_expected=True)
    assert patched <= TOLERANCE, f"{model_type} with images: hfpatch {patched:.2g}, stock {on_stock:.2g}"
    assert on_stock > WRONG, f"{model_type} with images: stock is right ({on_stock:.2g})"


@pytest.mark.parametrize("model_type", QWEN_VL)
def test_packed_rows_with_images_of_the_qwen_vl_family(model_type, probe):
    """Three sequences with an image each packed in a row, given each sequence's own multimodal rope
    positions (what its wrapper hands the text model alone), with and without a mask, or a collator's 2-D
    positions (each sequence from 0): each gets its own logits, and a packed training step its own loss
    and gradients; stock lets them see each other (and gives the image tokens text positions)."""
    probe.of(model_type, "sdpa")
    model = _qwen_vl_model(model_type, probe)
    seqs = [
        [5, 6, V_START, *[IMAGE] * 4, V_END, 7, 8, 9],
        [V_START, *[IMAGE] * 4, V_END, 10, 11],
        [12, 13, 14, V_START, *[IMAGE] * 4, V_END, 15],
    ]
    alone = [_alone_with_image(model, seq, seed) for seed, seq in enumerate(seqs)]
    ids = torch.tensor([[t for seq in seqs for t in seq]])
    inputs = {
        "input_ids": ids, "position_ids": torch.cat([p for _, p in alone], -1),
        **_image_inputs(model, ids, 3, [0, 1, 2]),
    }  # fmt: skip
    spans = [(sum(len(s) for s in seqs[:i]), len(seq)) for i, seq in enumerate(seqs)]
    collated = torch.tensor([[i for seq in seqs for i in range(len(seq))]])  # a collator's: text positions
    for mask, positions in ((None, None), (torch.ones_like(ids), None), (None, collated)):
        extra = {} if mask is None else {"attention_mask": mask}
        if positions is not None:  # (hfpatch: each sequence's own multimodal rope positions)
            extra["position_ids"] = positions
        with torch.no_grad():
            got = model(**{**inputs, **extra}).logits[0]
            with hfpatch.unpatched():
                wrong = model(**{**inputs, **extra}).logits[0]
        worst = max((got[s : s + n] - a).abs().max().item() for (s, n), (a, _) in zip(spans, alone))
        off = max((wrong[s : s + n] - a).abs().max().item() for (s, n), (a, _) in zip(spans, alone))
        assert worst <= TOLERANCE and off > WRONG, (mask is not None, positions is not None, worst, off)
    labels = ids.clone()
    for start, _ in spans:
        labels[0, start] = -100  # (a sequence's first token is no target of the one before)
    total = sum(len(seq) - 1 for seq in seqs)
    packed = _gradients(model, lambda: _summed_loss(model(**inputs), labels) / total)

    def alone_loss() -> torch.Tensor:
        rows = [torch.tensor([seq]) for seq in seqs]
        outs = [model(input_ids=row, **_image_inputs(model, row, 1, [seed])) for seed, row in enumerate(rows)]
        return sum(_summed_loss(out, row) for out, row in zip(outs, rows)) / total

    with hfpatch.unpatched():
        want = _gradients(model, alone_loss)
    assert packed.keys() == want.keys()
    assert max(((packed[k] - want[k]).norm() / want[k].norm().clamp(min=1e-12)).item() for k in want) <= 1e-4
