"""The decoders (and encoders) of encoder-decoder models: stock transformers is wrong, hfpatch is exact.

Every seq2seq adapter (hfpatch/adapters/seq2seq.py) on a tiny random model, eager and SDPA: a
left-padded decoder prompt in one call, a right-padded decoder prefix continued from the cache by one
and by two tokens, and (where the encoder's positions are absolute) a left-padded encoder input. The
reference is written here by hand: each row run alone, unpadded decoder input, the same encoder input,
one call, no mask.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any, Optional

import pytest
import torch
from packaging.version import Version
from probes import Probe, both_sides

import hfpatch
from hfpatch.support import NEWEST_TESTED, in_range, release_has
from hfpatch.verification.tiny import PAD, VOCAB, tiny_seq2seq
from hfpatch.windows import positional

from conftest import (
    REGISTRY,
    SEQ2SEQ_MODEL_TYPES,
    TF,
    arch_skip_reason,
    require_covered,
    reverted,
    stock,
)
from expectations import left_padding_wrong_on_stock
from harness import TOLERANCE, WRONG, cache_kwarg, output_cache, static_cache

SEQ2SEQ = [name for name, adapter in REGISTRY.items() if adapter.family.seq2seq]
QUICK = {"bart", "m2m_100", "t5", "whisper"}  # one per family
A, B = [11, 12, 13, 14, 15], [21, 22, 23]  # the two decoder rows (the decoder start token first on neither)

# name: (rows' tokens per call, left-padded in each call); rows A (5 tokens) and B (3)
SCENARIOS = {
    "left-padded prompt": (((5, 3),), ((True, True),)),
    "right-padded prefix + 1": (((4, 2), (1, 1)), ((False, False), (False, False))),
    "right-padded prefix + 2": (((3, 1), (2, 2)), ((False, False), (False, False))),
}


def _params() -> list[Any]:
    return [
        pytest.param(
            name, attention, id=f"{name}-{attention}", marks=() if name in QUICK else pytest.mark.slow
        )
        for name in SEQ2SEQ
        for attention in ("eager", "sdpa")
    ]


_models: dict[tuple[str, str], Any] = {}


def _model(name: str, attention: str, probe: Optional[Probe] = None) -> Any:
    require_covered(name, probe)
    if (name, attention) not in _models:
        try:
            _models[name, attention] = tiny_seq2seq(name, attention=attention)
        except (ValueError, ImportError) as exc:
            if attention == "sdpa" and ("sdpa" in str(exc).lower() or "scaled_dot_product" in str(exc)):
                pytest.skip(f"{name} does not support SDPA in transformers {TF}: {str(exc)[:200]}")
            raise
    return _models[name, attention]


def _encoder_input(model: Any, rows: int, seed: int = 0) -> torch.Tensor:
    """Random encoder inputs, one per row, none padded: token ids, features or raw audio."""
    generator = torch.Generator().manual_seed(seed)
    config, name = model.config, model.main_input_name
    if name == "input_ids":
        return torch.randint(3, VOCAB, (rows, 5), generator=generator)
    if name == "input_values":  # raw audio (Moonshine)
        return torch.randn(rows, 4000, generator=generator)
    if config.model_type == "whisper":  # mel bins x frames (twice the encoder's positions)
        return torch.randn(rows, config.num_mel_bins, 2 * config.max_source_positions, generator=generator)
    features = getattr(getattr(config, "encoder_config", None), "num_mel_bins", None)  # Parakeet encoders
    if features is None:
        features = config.input_feat_per_channel * config.input_channels  # Speech2Text
    return torch.randn(rows, 64, features, generator=generator)  # frames x features


def _channels(model: Any) -> int:
    """Dia's decoder takes audio codes [batch, tokens, channels]: 0 for token ids."""
    return getattr(getattr(model.config, "decoder_config", None), "num_channels", None) or 0


def _ids(model: Any, rows: list) -> torch.Tensor:
    """Decoder ids as the model takes them (audio codes: each token on every channel)."""
    ids, channels = torch.tensor(rows), _channels(model)
    return ids[..., None].repeat(1, 1, channels) if channels else ids


def _logits(model: Any, out: Any) -> torch.Tensor:
    """[batch, tokens, ...] (Dia's logits come as [batch * channels, tokens, vocab])."""
    channels, logits = _channels(model), out.logits
    return logits.view(-1, channels, *logits.shape[1:]).transpose(1, 2) if channels else logits


def _alone(model: Any, encoder_row: torch.Tensor, row: list[int]) -> torch.Tensor:
    """One row's decoder logits: its encoder input, its decoder tokens unpadded, one call, stock."""
    with torch.no_grad(), hfpatch.unpatched():
        inputs = {model.main_input_name: encoder_row[None], "decoder_input_ids": _ids(model, [row])}
        return _logits(model, model(**inputs))[0]


def _padded(
    model: Any, encoder: torch.Tensor, chunks: tuple, left: tuple, cache: Any = None, **flags: Any
) -> list[torch.Tensor]:
    """Rows A and B as one padded decoder batch, split into cached calls (the first given ``cache``, if
    any); each row's real-token logits."""
    rows, done, columns = (A, B), [0, 0], [[], []]
    logits: list[list[torch.Tensor]] = [[], []]
    for counts, lefts in zip(chunks, left):
        width, ids = max(counts), []
        real = []
        for r, (count, on_left) in enumerate(zip(counts, lefts)):
            tokens = rows[r][done[r] : done[r] + count]
            pads = [PAD] * (width - count)
            ids.append(pads + tokens if on_left else tokens + pads)
            real.append(range(width - count, width) if on_left else range(count))
            columns[r] += [1 if i in real[r] else 0 for i in range(width)]
            done[r] += count
        inputs = {
            model.main_input_name: encoder,
            "decoder_input_ids": _ids(model, ids),
            "decoder_attention_mask": torch.tensor(columns),  # past + new tokens
            **flags,
        }
        if cache is not None:
            inputs[cache_kwarg(model)] = cache
        with torch.no_grad():
            out = model(**inputs)
        returned = output_cache(out)
        cache = returned if returned is not None else cache  # none returned: the one passed goes on
        for r in range(2):
            logits[r] += [_logits(model, out)[r, i] for i in real[r]]
    return [torch.stack(row) for row in logits]


def _decoder_error(model: Any, chunks: tuple, left: tuple, cache: Any = None, **flags: Any) -> float:
    encoder = _encoder_input(model, 2)
    got = _padded(model, encoder, chunks, left, cache, **flags)
    return max((_alone(model, encoder[r], row) - got[r]).abs().max().item() for r, row in enumerate((A, B)))


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("name, attention", _params())
def test_decoder_rows_equal_themselves_alone(name, attention, scenario, probe):
    probe.of(name, attention)
    model = _model(name, attention, probe)
    chunks, left = SCENARIOS[scenario]
    # Dia returns a cache only when the call asks (its config's use_cache is not read); SwitchTransformers
    # raises when the call asks (its encoder gets the flag too)
    flags = {"use_cache": True} if _channels(model) else {}
    patched, on_stock = both_sides(probe, lambda: _decoder_error(model, chunks, left, **flags))
    wrong_on_stock = scenario != "left-padded prompt" or left_padding_wrong_on_stock(REGISTRY[name])
    probe.judge(patched, on_stock, wrong_on_stock)
    assert patched <= TOLERANCE, (
        f"{name} ({attention}), {scenario}: hfpatch {patched:.2g}, stock {on_stock:.2g}"
    )
    if wrong_on_stock:
        assert on_stock > WRONG, (
            f"{name}, {scenario}: stock is right ({on_stock:.2g}): the declaration is stale"
        )


def _static(model: Any) -> Any:
    """What ``generate(cache_implementation="static")`` makes: the decoder's self-attention keys in a
    StaticCache of 16 slots, the cross-attention's in a growing cache."""
    import transformers

    return transformers.EncoderDecoderCache(static_cache(model, 2, 16), transformers.DynamicCache())


def _static_skip_reason(model: Any) -> str | None:
    import transformers

    if not hasattr(transformers, "EncoderDecoderCache") or not hasattr(transformers, "StaticCache"):
        return f"no EncoderDecoderCache or StaticCache in transformers {TF}"
    encoder = _encoder_input(model, 2)
    try:
        with stock(), torch.no_grad():
            model(**{model.main_input_name: encoder}, decoder_input_ids=_ids(model, [A[:2], B[:2]]),
                  decoder_attention_mask=torch.tensor([[1, 1], [0, 1]]),
                  **{cache_kwarg(model): _static(model)})  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - what stock transformers says is the fact to report
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return f"{type(model).__name__} takes no static decoder cache in transformers {TF}: {why}"[:300]
    return None


@pytest.mark.parametrize("name, attention", _params())
def test_decoder_with_a_static_cache_rows_equal_themselves_alone(name, attention, probe):
    """A right-padded decoder prefix continued by two tokens, the decoder's keys in a StaticCache (more
    slots than the mask of past + new covers: T5's relative bias spans them all). Stock may also raise
    there (MVP on 5.4-5.12 counts the past as a tensor and hands it to ``arange``): wrong too."""
    probe.of(name, attention)
    model = _model(name, attention, probe)
    reason = _static_skip_reason(model)
    if reason is not None:
        pytest.skip(reason)
    chunks, left = SCENARIOS["right-padded prefix + 2"]
    flags = {"use_cache": True} if _channels(model) else {}
    patched, on_stock = both_sides(
        probe, lambda: _decoder_error(model, chunks, left, _static(model), **flags), (TypeError, RuntimeError)
    )
    probe.judge(patched, on_stock, stock_wrong_expected=True)
    assert patched <= TOLERANCE, (
        f"{name} ({attention}), StaticCache: hfpatch {patched:.2g}, stock {on_stock:.2g}"
    )
    assert on_stock > WRONG, f"{name}, StaticCache: stock is right ({on_stock:.2g}): the entry is stale"


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_bert_as_a_decoder_rows_equal_themselves_alone(scenario):
    """BERT as the decoder of an encoder-decoder model (BertLMHeadModel, patched by the 'bert' adapter):
    absolute positions, so stock is wrong in every scenario."""
    require_covered("bert")
    if ("encoder-decoder", "eager") not in _models:
        try:
            _models["encoder-decoder", "eager"] = tiny_seq2seq("encoder-decoder", attention="eager")
        except (ValueError, TypeError, AssertionError) as exc:  # before 5.0 it needs its encoder and decoder
            pytest.skip(f"no tiny encoder-decoder model from defaults in transformers {TF}: {str(exc)[:100]}")
    model = _models["encoder-decoder", "eager"]
    chunks, left = SCENARIOS[scenario]
    patched = _decoder_error(model, chunks, left, use_cache=True)
    with stock():
        on_stock = _decoder_error(model, chunks, left, use_cache=True)
    assert patched <= TOLERANCE, f"bert as a decoder, {scenario}: hfpatch {patched:.2g}, stock {on_stock:.2g}"
    assert on_stock > WRONG, f"bert as a decoder, {scenario}: stock is right ({on_stock:.2g})"


ENCODERS = [
    pytest.param(name, id=name, marks=() if name in QUICK else pytest.mark.slow)
    for name in SEQ2SEQ
    if REGISTRY[name].also or REGISTRY[name].family.hands_to == "relative bias"
]


def _encoder_error(model: Any) -> float:
    """A left-padded encoder input (attention_mask), decoder unpadded: the padded row against itself alone."""
    encoder = torch.tensor([[31, 32, 33, 34, 35], [PAD, PAD, 41, 42, 43]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    with torch.no_grad():
        got = model(input_ids=encoder, attention_mask=mask, decoder_input_ids=torch.tensor([B, B])).logits[1]
        with hfpatch.unpatched():
            alone = model(input_ids=encoder[1:, 2:], decoder_input_ids=torch.tensor([B])).logits[0]
    return (got - alone).abs().max().item()


@pytest.mark.parametrize("name", ENCODERS)
def test_left_padded_encoder_equals_itself_alone(name, probe):
    probe.of(name, "eager")
    model = _model(name, "eager", probe)
    patched, on_stock = both_sides(probe, lambda: _encoder_error(model))
    probe.judge(patched, on_stock, stock_wrong_expected=bool(REGISTRY[name].also))
    assert patched <= TOLERANCE, f"{name}: hfpatch {patched:.2g}, stock {on_stock:.2g}"
    if REGISTRY[name].also:  # absolute positions: the encoder is wrong on stock
        assert on_stock > WRONG, f"{name}: stock is right ({on_stock:.2g}): the declaration is stale"


WINDOWED = ["t5gemma", "t5gemma2"]  # decoders with sliding-window layers


@contextlib.contextmanager
def _window(model: Any, size: int) -> Iterator[None]:
    """Every sliding window of ``model`` set to ``size`` on its configs (its masks and caches read them at
    call time), for the block."""
    configs = [getattr(module, "config", None) for module in model.modules()]
    configs = [config for config in configs if getattr(config, "sliding_window", None)]
    saved = [config.sliding_window for config in configs]
    for config in configs:
        config.sliding_window = size
    try:
        yield
    finally:
        for config, window in zip(configs, saved):
            config.sliding_window = window


def _past_the_window_error(model: Any, rows: tuple) -> float:
    """Rows of 11 and 5 tokens: a right-padded prefix of 10 and 4 continued by one token each."""
    encoder = _encoder_input(model, 2)
    prefix = torch.tensor([rows[0][:10], rows[1][:4] + [PAD] * 6])
    mask = torch.tensor([[1] * 10, [1] * 4 + [0] * 6])
    with torch.no_grad():
        first = model(input_ids=encoder, decoder_input_ids=prefix, decoder_attention_mask=mask)
        second = model(
            input_ids=encoder, decoder_input_ids=torch.tensor([[rows[0][10]], [rows[1][4]]]),
            decoder_attention_mask=torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1),
            **{cache_kwarg(model): output_cache(first)},
        )  # fmt: skip
    got = [torch.cat([first.logits[0], second.logits[0]]), torch.cat([first.logits[1, :4], second.logits[1]])]
    return max((_alone(model, encoder[r], row) - got[r]).abs().max().item() for r, row in enumerate(rows))


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("name", WINDOWED)
def test_decoder_window_is_decided_by_position(name, attention, probe):
    """A decoder with a sliding window of 4: by cache column the short row's window holds its pads, so
    stock is wrong past the window; hfpatch decides it by position."""
    probe.of(name, attention)
    model = _model(name, attention, probe)
    if not positional(model, REGISTRY[name].cls):  # T5Gemma 2 on 5.4-5.14 (docs/how-it-works.md)
        assert TF < Version(NEWEST_TESTED), f"{name}: windows left to transformers on the newest release"
        pytest.skip(f"{name}'s decoder in transformers {TF} cannot take window masks: left to transformers")
    rows = (list(range(11, 22)), list(range(31, 36)))
    with _window(model, 4):
        patched, on_stock = both_sides(probe, lambda: _past_the_window_error(model, rows))
    probe.judge(patched, on_stock, stock_wrong_expected=True)
    assert patched <= TOLERANCE, f"{name} ({attention}): hfpatch {patched:.2g}, stock {on_stock:.2g}"
    assert on_stock > WRONG, f"{name}: stock is right ({on_stock:.2g}): the test misses the window"


def test_explicit_decoder_inputs_are_untouched():
    """No mask: stock, bit for bit (the position module is handed nothing)."""
    model = _model("bart", "eager")
    encoder = _encoder_input(model, 2)
    with torch.no_grad():
        patched = model(input_ids=encoder, decoder_input_ids=torch.tensor([A, A])).logits
        with stock():
            on_stock = model(input_ids=encoder, decoder_input_ids=torch.tensor([A, A])).logits
    assert torch.equal(patched, on_stock)


@pytest.mark.slow  # dynamo traces a whole decoder twice (about 30 s): CI runs it on every release it tests
@pytest.mark.parametrize("name", ["bart", "t5"])  # a position table, the relative bias
def test_compiled_decoder_matches_eager(name):
    """The handoff traces: no graph break where stock has none (one graph), and where stock breaks (4.49's
    T5 logs a warning for a tuple cache) only at stock's own lines (the patched forward's frame around
    the original meets the same break once more); eager's result (a decode step after a padded prefix)."""
    model = _model(name, "eager")
    encoder = _encoder_input(model, 2)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 1]])
    ids = torch.tensor([[15], [23]])
    with torch.no_grad():
        first = model(input_ids=encoder, decoder_input_ids=torch.tensor([A[:4], B[:2] + [PAD, PAD]]),
                      decoder_attention_mask=mask[:, :4])  # fmt: skip
        decoder = model.get_decoder()
        kwargs = dict(
            input_ids=ids, attention_mask=mask, encoder_hidden_states=first.encoder_last_hidden_state
        )
        cached = output_cache(first)
        eager = decoder(**kwargs, past_key_values=_copy(cached)).last_hidden_state
        torch._dynamo.reset()
        explained = torch._dynamo.explain(decoder)(**kwargs, past_key_values=_copy(cached))
        with reverted():
            torch._dynamo.reset()
            stock_breaks = torch._dynamo.explain(decoder)(**kwargs, past_key_values=_copy(cached))
        torch._dynamo.reset()
        whole = stock_breaks.graph_break_count == 0
        if whole:
            assert explained.graph_break_count == 0, explained.break_reasons
        assert _break_lines(explained) <= _break_lines(stock_breaks), explained.break_reasons
        compiled = torch.compile(decoder, fullgraph=whole)(**kwargs, past_key_values=_copy(cached))
    torch._dynamo.reset()
    assert (compiled.last_hidden_state - eager).abs().max().item() <= TOLERANCE


def _break_lines(explained: Any) -> set[tuple[str, int]]:
    """Where the graph breaks of a ``torch._dynamo.explain`` result are: (file, line) of each."""
    frames = [reason.user_stack[-1] for reason in explained.break_reasons if reason.user_stack]
    return {(frame.filename, frame.lineno) for frame in frames}


def _copy(cache: Any) -> Any:
    import copy

    return copy.deepcopy(cache)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("name", ["whisper", "bart", "m2m_100", pytest.param("t5", marks=pytest.mark.slow)])
def test_generate_with_left_padded_decoder_prompts(name, cache):
    """Per-row decoder prompts, left-padded, in one generate() call: each row's scores and tokens are its
    own alone. generate() extends decoder_attention_mask and passes no decoder positions, so stock is
    wrong where positions are absolute (BART's and M2M100's tables; Whisper on 5.3-5.15, where generate()
    passed none: fixed upstream in 5.16 by PR #48028, elsewhere it passes its own and hfpatch changes
    nothing) and right with T5's relative bias (a uniform shift cancels). M2M100 counts the non-pad ids
    of a call plus the past length: right in one call, wrong from the first generated token. With
    ``cache_implementation="static"``, generate() hands the decoder a 4-D mask made from the 2-D one;
    hfpatch reads the positions from the 2-D mask all the same."""
    model = _model(name, "eager")
    if cache == "static" and _static_skip_reason(model):
        pytest.skip(_static_skip_reason(model))
    prepare = inspect.getsource(type(model).prepare_inputs_for_generation)
    if "decoder_attention_mask" not in prepare:  # a call without a mask is stock's (M2M100 before 4.46 ...)
        pytest.skip(f"generate() in transformers {TF} does not hand {name} its decoder_attention_mask")
    encoder = _encoder_input(model, 2)
    start = model.generation_config.decoder_start_token_id
    if start is None:  # the tiny T5 config names none
        start = model.generation_config.decoder_start_token_id = 2
    a, b = [start, *A[:4]], [start, B[0]]
    ids = torch.tensor([a, [PAD] * 3 + b])
    mask = torch.tensor([[1] * 5, [0, 0, 0, 1, 1]])
    settings = dict(max_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True)
    if cache == "static":
        settings["cache_implementation"] = "static"

    def worst() -> float:
        with torch.no_grad():
            batch = model.generate(encoder, decoder_input_ids=ids, decoder_attention_mask=mask, **settings)
            error = 0.0
            for r, row in enumerate((a, b)):
                alone = model.generate(encoder[r : r + 1], decoder_input_ids=torch.tensor([row]), **settings)
                error = max(
                    error, *((s[r] - t[0]).abs().max().item() for s, t in zip(batch.scores, alone.scores))
                )
                new = alone.sequences[0, len(row) :].tolist()
                if batch.sequences[r, ids.shape[1] : ids.shape[1] + len(new)].tolist() != new:
                    error = max(error, float("inf"))  # another token: the rest is not comparable
        return error

    try:
        with stock():
            on_stock = worst()
    except (KeyError, TypeError, ValueError) as exc:  # (on stock: 4.43's Whisper, 4.52-4.54's others)
        with pytest.raises(type(exc)):
            worst()
        pytest.skip(f"{name}: generate() with a {cache} cache raises on stock {TF} too: {exc!r:.120}")
    patched = worst()
    assert patched <= TOLERANCE, f"{name}: hfpatch {patched:.2g}, stock {on_stock:.2g}"
    # absolute positions, counted from cache columns: the steps after a left-padded prompt count its pads
    wrong_on_stock = {"whisper": in_range(">=5.3,<5.16", TF), "bart": True, "m2m_100": True, "t5": False}
    if wrong_on_stock[name]:
        assert on_stock > WRONG, f"{name}: stock is right ({on_stock:.2g}) on {TF}"
    else:
        assert on_stock <= TOLERANCE, f"{name}: stock is wrong ({on_stock:.2g}) on {TF}"


def test_status_lists_every_seq2seq_model_type():
    """Every model type of the seq2seq, speech-seq2seq and image-text-to-text mappings has its entry."""
    status = hfpatch.status()
    missing = sorted(set(SEQ2SEQ_MODEL_TYPES) - set(status))
    assert not missing, f"declare these in hfpatch/adapters/seq2seq.py or wrappers.py: {missing}"
    for name in SEQ2SEQ:
        if release_has(REGISTRY[name]) and not arch_skip_reason(name):
            assert status[name].state in ("applied", "waiting for import"), status[name]


def test_revert_restores_every_class_patched_with_a_seq2seq_adapter():
    """The decoder, its encoder and the position module get their original functions back, exactly."""
    import importlib

    if arch_skip_reason("bart"):
        pytest.skip(arch_skip_reason("bart"))
    adapter = REGISTRY["bart"]
    module = importlib.import_module(adapter.module)
    classes = [
        (adapter.cls, "forward"),
        *((cls, "forward") for cls in adapter.also),
        (adapter.receiver, "forward"),
    ]
    hfpatch.revert("bart")
    originals = {(cls, name): getattr(module, cls).__dict__[name] for cls, name in classes}
    hfpatch.apply("bart")
    patched = {(cls, name): getattr(module, cls).__dict__[name] for cls, name in classes}
    assert all(patched[key] is not originals[key] for key in classes)
    hfpatch.revert("bart")
    assert all(getattr(module, cls).__dict__[name] is originals[cls, name] for cls, name in classes)


STANDALONE = [
    "bart",
    pytest.param("marian", marks=pytest.mark.slow),
    pytest.param("pegasus", marks=pytest.mark.slow),
]


def _standalone(name: str) -> Any:
    """The decoder run as a causal LM (``BartForCausalLM`` ...), as transformers' own
    ``BartStandaloneDecoderModelTest`` builds it."""
    import transformers

    from hfpatch.verification.tiny import SEQ2SEQ_SIZES, SIZES, tiny_config

    if arch_skip_reason(name):
        pytest.skip(arch_skip_reason(name))
    config = tiny_config(name, {**SIZES, **SEQ2SEQ_SIZES})
    config.is_decoder, config.is_encoder_decoder = True, False
    config.max_position_embeddings = 64
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).float().eval()


def _random_mask_generate(model: Any, forward: Any = None, **options: Any) -> Any:
    """generate() on prompts with a random 0/1 mask (legal inputs: transformers' testers use them)."""
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(3, VOCAB, (3, 7), generator=generator)
    mask = torch.randint(0, 2, (3, 7), generator=generator)
    mask[:, -1] = 1
    settings = dict(max_new_tokens=5, do_sample=False, output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, pad_token_id=PAD, **settings, **options)


def _stock_static_generate(model: Any) -> Any:
    """Stock's generate() with a static cache, or a skip saying why it cannot run here."""
    try:
        with stock():
            return _random_mask_generate(model, cache_implementation="static")
    except Exception as exc:  # noqa: BLE001 - what stock transformers says is the fact to report
        pytest.skip(
            f"{type(model).__name__}.generate() with a static cache fails on stock {TF}: {str(exc)[:150]}"
        )


def _same_generation(a: Any, b: Any) -> float:
    assert torch.equal(a.sequences, b.sequences)
    return max((x - y).abs().max().item() for x, y in zip(a.scores, b.scores))


@pytest.mark.parametrize("name", STANDALONE)
def test_standalone_decoder_generates_the_same_with_a_static_cache(name):
    """transformers' ``test_generate_with_static_cache`` of the standalone decoders (BART, Marian,
    Pegasus as causal LMs): a static cache hands the decoder a 4-D mask made from the 2-D one, and its
    positions are read from that 2-D mask as with the dynamic cache, so the two generate the same; and
    differently from stock, whose positions ignore the mask's holes either way."""
    model = _standalone(name)
    on_stock = _stock_static_generate(model)
    dynamic = _random_mask_generate(model)
    static = _random_mask_generate(model, cache_implementation="static")
    assert _same_generation(dynamic, static) <= TOLERANCE
    assert max((x - y).abs().max().item() for x, y in zip(on_stock.scores, static.scores)) > WRONG


@pytest.mark.slow
@pytest.mark.compile
def test_standalone_decoder_compiled_with_a_static_cache_generates_the_same():
    """transformers' ``test_generate_compile_model_forward_fullgraph``: the forward compiled with
    ``fullgraph=True`` generates with a static cache what the eager forward does with a dynamic one, in
    as many graphs as stock compiles."""
    from torch._dynamo.utils import counters

    model = _standalone("bart")
    _stock_static_generate(model)
    eager = _random_mask_generate(model)
    graphs = {}
    for side in ("stock", "hfpatch"):
        torch._dynamo.reset()
        counters.clear()
        model.forward = torch.compile(type(model).forward.__get__(model), fullgraph=True, backend="eager")
        try:
            with reverted() if side == "stock" else contextlib.nullcontext():  # compiled code: the class's
                result = _random_mask_generate(model, cache_implementation="static")
        finally:
            del model.forward
            torch._dynamo.reset()
        graphs[side] = counters["stats"]["unique_graphs"]
    assert _same_generation(eager, result) <= TOLERANCE
    assert graphs["hfpatch"] <= graphs["stock"], graphs
