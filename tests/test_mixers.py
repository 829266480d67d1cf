"""Layers that carry a state from token to token (hfpatch.mixers): a short convolution (LFM2), a gated delta
rule (Qwen3.5), a selective SSM (Mamba, no attention at all), Mamba2 (Nemotron-H), lightning attention
(MiniMax), KDA (Kimi Linear), RWKV and mLSTM (xLSTM), whose layers are handed the state itself. Each kind
against each sequence run alone, unpadded, in one call, on stock transformers (harness.run_alone): packed
rows in every form a collator makes, padded batches split into KV-cached calls (random lengths), a packed
training step's loss and gradients (checkpointed too), an unpadded call whose cache ``generate()``
continues. Stock is wrong in each (the test shows something)."""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import types
import warnings

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from test_packed import (
    CHECKPOINTING,
    NO_DROPOUT,
    SEQUENCES,
    _layers,
    pack,
    packed_grads,
    relative,
    run_layout,
    sequence_grads,
    worst,
)

import hfpatch
from hfpatch.mixers import runs_of

from conftest import REGISTRY, TF, arch_skip_reason, stock
from harness import TOLERANCE, WRONG, cache_kwarg, max_diff, output_cache, run_alone, run_padded, tolerance_of

pytestmark = pytest.mark.invariant("I9")

# one model type a kind of layer; the quick suite runs two (a hybrid, and a model of state layers alone)
KINDS = {
    "gated delta rule": "qwen3_5_text",
    "selective SSM": "mamba",
    "short convolution": "lfm2",
    "Mamba2": "nemotron_h",
    "lightning attention": "minimax",
    "KDA": "kimi_linear",
    "RWKV (its state handed on)": "rwkv",
    "mLSTM (its state handed on)": "xlstm",
    "RG-LRU (its state kept on the layer)": "recurrent_gemma",
}
QUICK = {"gated delta rule", "selective SSM"}
# layers handed their state, or keeping it on themselves, that take no mask of their own: torch's
# checkpoint_wrapper recomputes them outside the call, where nothing carries its sequences: such a call runs
# as on stock, with a warning; so too a hybrid's whose release makes them no mask of their own (4.x: no
# create_recurrent_attention_mask)
HANDED = {"rwkv", "xlstm", "recurrent_gemma"}


def uncarried(model) -> bool:
    """Nothing carries a call's sequences into a recomputation by torch's ``checkpoint_wrapper``."""
    arch = model.config.model_type
    module = inspect.getmodule(type(model))
    own_mask = hasattr(module, "create_recurrent_attention_mask") or not REGISTRY[arch].family.attends
    return arch in HANDED or not own_mask


# measured: where stock itself raises on the tests' rows (the release probe covers these releases)
STOCK_RAISES = {
    "xlstm": (
        SpecifierSet("<5.2"),
        "stock's own chunkwise kernel raises on a row of 8 tokens ('Tensor' is not callable)",
    ),
    "nemotron_h": (  # (5.13.1 and 5.15.1 run; 5.14.0's cache_utils reads as 5.14.1's)
        SpecifierSet(">=5.14,<5.15"),
        "stock's own DynamicCache(config=...) has no layer for its MLP blocks (KeyError: 'mlp'): every call"
        " that makes its cache raises",
    ),
}
# a model that returns no cache (its layers keep their state): its caller passes one and keeps it
RETURNS_NO_CACHE = {"recurrent_gemma"}
# releases whose stock continues no call of the model right, even unpadded (5.18-5.22 and 5.25 count
# RecurrentGemma's cache on a layer it never writes: 0, and its positions and attention mask restart;
# measured: 5.12-5.17's model counted on its first attention layer, 5.23-5.24's cache skips state layers):
# the pieces of split_noise run patched there (each row alone, no pad: what hfpatch fixes is that count)
MISCOUNTS = {"recurrent_gemma": (SpecifierSet(">=5.18,<5.23"), SpecifierSet(">=5.25"))}


def packed_kept(model) -> None:
    """Skip where the release keeps no packed row of the model (``status()`` says why: RecurrentGemma
    before 5.4, whose attention keeps its keys on itself)."""
    said = hfpatch.status()[model.config.model_type].packed
    if not said.startswith("yes"):
        pytest.skip(f"{model.config.model_type}: packed rows not kept in transformers {TF}: {said}")


def takes_slots(model) -> bool:
    """A 4.x model whose continued calls need their ``cache_position`` (RecurrentGemma's, which keeps its
    keys on itself): a caller passes it, as ``generate()`` does. (4.x Mamba's, with ``cache_params``:
    hfpatch makes them where the caller passes none; stock refuses to.)"""
    parameters = inspect.signature(model.forward).parameters
    return "cache_position" in parameters and "cache_params" not in parameters and TF < Version("5.0")


def demands_slots(model) -> bool:
    """Whether stock's continued call needs its ``cache_position``: RecurrentGemma's before 5.0, Mamba's (with
    ``cache_params``) before 5.4 ("You have to specify the `cache_position` manually", read in 5.0.0-5.4.0's
    modeling_mamba.py)."""
    parameters = inspect.signature(model.forward).parameters
    until = "5.4" if "cache_params" in parameters else "5.0"
    return "cache_position" in parameters and TF < Version(until)


def stock_slots(model, first: int, taken: int, n: int) -> dict:
    """What stock's continued call of ``n`` tokens after ``taken`` needs besides (its first took ``first``):
    RecurrentGemma's slots; 4.x Mamba's as ``generate()`` counts them, from its convolution's width (a
    fresh call's, which the model makes itself: the first passes none)."""
    parameters = inspect.signature(model.forward).parameters
    if not demands_slots(model):
        return {}
    if "cache_params" not in parameters:
        return {"cache_position": torch.arange(taken, taken + n)}
    return {"cache_position": torch.arange(n) + model.config.conv_kernel + taken - first} if taken else {}


def first_cache(model):
    """The cache a run starts from: None (the model makes one and returns it), or a ``DynamicCache`` made
    here for a model that returns none (and takes one: 5.x RecurrentGemma)."""
    if model.config.model_type not in RETURNS_NO_CACHE or cache_kwarg(model) is None:
        return None
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def left_to_stock(model, run) -> None:
    """``run()`` warns that the call's sequences are not kept, and gives what it gives on stock (the whole
    call runs as stock runs it)."""
    with pytest.warns(RuntimeWarning, match="checkpoint_wrapper"):
        got = run()
    with stock():
        assert run() == got


PARAMS = [
    pytest.param(arch, id=kind, marks=() if kind in QUICK else pytest.mark.slow)
    for kind, arch in KINDS.items()
]


def hybrid(arch: str, **sizes):
    """The tiny model of ``arch`` with eager attention (a model without attention takes no other)."""
    from hfpatch.verification.tiny import tiny_model

    reason = arch_skip_reason(arch)
    if reason:
        pytest.skip(reason)
    if arch in STOCK_RAISES and STOCK_RAISES[arch][0].contains(TF, prereleases=True):
        pytest.skip(f"{arch} in transformers {TF}: {STOCK_RAISES[arch][1]}")
    importlib.import_module(REGISTRY[arch].module)  # (patched on import: its status is its class's)
    said = hfpatch.status()[arch].packed
    if "keeps its keys" in said:  # (RecurrentGemma before 5.4: its layers too run as transformers runs them)
        pytest.skip(f"{arch} in transformers {TF}: {said}")
    return tiny_model(arch, attention="eager", sizes=sizes or None)


def test_runs_of_groups_a_calls_sequences():
    """A packed row and a padded batch as their mixers run them: each sequence once, groups of one
    length where the states are kept (similar length where not), the cache row each continues and ends."""
    real = torch.tensor([[True] * 6, [False, True, True, True, True, False]])
    segments = torch.tensor([[0, 0, 0, 1, 1, 2], [0, 0, 0, 0, 0, 0]])
    runs = runs_of(real, segments, torch.device("cpu"), continues=True, keeps=True)
    found = sorted(
        (g.index.tolist(), None if g.source is None else g.source.tolist(), g.rows.tolist())
        for g in runs.groups
    )
    assert found == [
        ([[0, 1, 2]], [0], []),  # row 0's first sequence continues its row; not its last
        ([[3, 4]], None, []),  # a sequence inside a row starts fresh
        ([[5]], None, [0]),  # row 0's last sequence ends the row's state
        ([[7, 8, 9, 10]], [1], [1]),  # row 1: one sequence between its pads
    ]
    loose = runs_of(real, segments, torch.device("cpu"), continues=False, keeps=False)
    assert sorted(g.index.shape[1] for g in loose.groups) == [1, 2, 4]  # (lengths up to a power of 2)
    one_row = torch.ones(1, 5, dtype=torch.bool), torch.tensor([[0, 0, 1, 1, 2]]), torch.device("cpu")
    unpadded = runs_of(*one_row, continues=False, keeps=True, unpadded=2)
    assert sorted(g.rows.tolist() for g in unpadded.groups) == [
        [],
        [0, 1],
    ]  # (a third sequence: kept nowhere)
    assert unpadded.states == 2


LAYOUTS = [
    "no mask",
    "no mask, use_cache=False",
    "an all-ones mask",
    "two right-padded rows",
    "an empty cache passed",
]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("arch", PARAMS)
def test_each_packed_sequence_alone(arch, layout):
    model = hybrid(arch)
    packed_kept(model)
    try:
        logits, spans, _ = run_layout(model, layout)
    except (ValueError, TypeError, AttributeError, KeyError) as exc:  # MiniMax, RWKV, xLSTM: own caches
        if layout != "an empty cache passed":
            raise
        with stock(), pytest.raises(type(exc)):
            run_layout(model, layout)
        pytest.skip(f"{type(model).__name__} takes no DynamicCache, on stock alike: {exc}")
    assert worst(model, logits, spans) <= TOLERANCE
    assert type(logits) is torch.Tensor  # (not hfpatch's mask carrier)
    with stock():
        wrong, _, _ = run_layout(model, layout)
    assert worst(model, wrong, spans) > WRONG, "stock is right here: the test shows nothing"


@pytest.mark.parametrize("arch", PARAMS)
def test_sequences_given_by_their_lengths(arch):
    """DataCollatorWithFlattening's other batches: ``cu_seq_lens_*`` (``return_flash_attn_kwargs``, what
    the GPU kernels of these layers read) or ``seq_idx``, positions or not; transformers' torch paths
    raise or leak given them."""
    import transformers

    model = hybrid(arch)
    packed_kept(model)
    if "return_seq_idx" not in inspect.signature(transformers.DataCollatorWithFlattening.__init__).parameters:
        pytest.skip(f"DataCollatorWithFlattening gives positions alone in transformers {TF}")
    features = [{"input_ids": list(seq)} for seq in SEQUENCES]
    spans = [(0, sum(len(s) for s in SEQUENCES[:i]), seq) for i, seq in enumerate(SEQUENCES)]
    for options in (
        {"return_flash_attn_kwargs": True},
        {"return_seq_idx": True},
        {"return_flash_attn_kwargs": True, "return_position_ids": True},
    ):
        batch = transformers.DataCollatorWithFlattening(**{"return_position_ids": False, **options})(features)
        batch.pop("labels")
        with torch.no_grad():
            assert worst(model, model(**batch).logits, spans) <= TOLERANCE, options


# a padded batch split into KV-cached calls: left and right padding, a padded prefix continued (holes),
# rows that sit a call out, by one token and by several
CASES = {
    "right-padded prefix + 1": ([[5, 6, 7, 8], [9, 10]], [[3, 1], [1, 1]], [[False, False], [False, False]]),
    "right-padded prefix + 3": ([[5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15, 16]], [[2, 4], [3, 3]],
                                [[False, False], [False, False]]),
    "four calls": ([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14], [15, 16, 17, 18, 19]],
                   [[2, 1, 2], [1, 2, 0], [2, 0, 2], [1, 1, 1]],
                   [[False, True, False], [True, False, False], [False, False, True], [False, True, False]]),
}  # fmt: skip


@pytest.mark.invariant("I1")
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("arch", PARAMS)
def test_padded_batches_split_into_cached_calls(arch, case):
    model = hybrid(arch)
    rows, chunks, left = CASES[case]
    noise = split_noise(model, rows, chunks)
    assert noise <= 1e-4, (
        f"each row alone, in pieces, is wrong on stock ({noise:.2g}): the test shows nothing"
    )
    tolerance = max(tolerance_of(model, rows), 4 * noise)
    slots = takes_slots(model)
    assert (
        max_diff(model, rows, run_padded(model, rows, chunks, left, first_cache(model), None, slots))
        <= tolerance
    )
    # stock given the slots a 4.x caller passes (4.x Mamba's stock call demands them: a caller's arange)
    given = demands_slots(model)
    with stock():
        try:
            wrong = max_diff(
                model, rows, run_padded(model, rows, chunks, left, first_cache(model), None, given)
            )
        except RuntimeError:  # (stock Mamba: the mask of past + new tokens meets a step of the new ones)
            wrong = float("inf")
    assert wrong > WRONG, "stock is right here: the test shows nothing"


def split_noise(model, rows, chunks) -> float:
    """fp32's own noise of a recurrence run in pieces (a chunked scan, then steps: two algorithms): each row
    alone, unpadded, on stock, its first call's tokens in one call and the rest one at a time (the path
    every model continues right: some restart their state in a cached call of several), against it in one
    call. The first call takes two tokens at least (RecurrentGemma's first call of one token continues
    what its layers last held, on stock)."""
    worst, name = 0.0, cache_kwarg(model)
    for r, row in enumerate(rows):
        counts = [c[r] for c in chunks if c[r]]
        first = min(len(row), max(counts[0], 2))
        cache, taken, pieces = first_cache(model), 0, []
        miscounts = any(r.contains(TF, prereleases=True) for r in MISCOUNTS.get(model.config.model_type, ()))
        with contextlib.nullcontext() if miscounts else stock(), torch.no_grad():
            for n in [first] + [1] * (len(row) - first):  # (no mask: every token real)
                extra = {name: cache} if name is not None else {}
                extra.update(stock_slots(model, first, taken, n))
                out = model(input_ids=torch.tensor([row[taken : taken + n]]), use_cache=True, **extra)
                returned = output_cache(out)
                cache, taken = cache if returned is None else returned, taken + n
                pieces.append(out.logits[0])
        worst = max(worst, max_diff(model, [row], [torch.cat(pieces)]))
    return worst


@pytest.mark.invariant("I1")
@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_random_padded_and_packed_batches(data):
    """A property over random lengths: a Qwen3.5 batch padded either side, split into cached calls, or a
    row packing random sequences, each sequence against itself alone."""
    from compat.cases import random_case

    model = _shared("qwen3_5_text")

    class Draw:
        def randint(self, low, high):
            return data.draw(st.integers(low, high))

        def random(self):
            return data.draw(st.floats(0, 1))

    rows, chunks, left = random_case(Draw(), max_batch=3, max_calls=3, max_new=5)
    # a call of one token a row whose token is a pad (a row that sits a decode step out) moves that row's
    # state, as on stock: a declared limit (transformers' own rule: a generated token is never a pad)
    assume(not any(max(counts) == 1 and min(counts) == 0 for counts in chunks))
    assert max_diff(model, rows, run_padded(model, rows, chunks, left)) <= TOLERANCE
    lengths = data.draw(st.lists(st.integers(1, 7), min_size=2, max_size=4))
    sequences = [tuple(range(3 + 10 * i, 3 + 10 * i + n)) for i, n in enumerate(lengths)]
    kwargs, spans = pack([sequences], mask=data.draw(st.booleans()))
    with torch.no_grad():
        assert worst(model, model(**kwargs).logits, spans) <= TOLERANCE


_built: dict = {}


def _shared(arch: str):
    if arch not in _built:
        _built[arch] = hybrid(arch)
    return _built[arch]


@pytest.mark.invariant("I8")
@pytest.mark.parametrize("checkpointing", CHECKPOINTING)
@pytest.mark.parametrize("arch", PARAMS)
def test_packed_training_step_is_the_sequences_own(arch, checkpointing, fresh_warnings):
    """A packed training step (train mode, labels, no mask, the cache the model makes): the loss and
    gradients of its sequences alone; a layer recomputed in the backward pass runs the call's sequences
    alike, whoever checkpoints it (transformers: the call's context, hfpatch._context.CarryContext; torch's
    ``checkpoint_wrapper``, as FSDP applies it: the mask its state layers take carries them)."""
    model = hybrid(arch, **NO_DROPOUT).train()
    packed_kept(model)
    if checkpointing is not None and checkpointing.startswith("checkpoint_wrapper"):  # as FSDP wraps blocks
        from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as torch_wrapper

        blocks = type(_layers(model)[0])
        impl = torch_wrapper.CheckpointImpl
        wrap = functools.partial(
            torch_wrapper.checkpoint_wrapper,
            checkpoint_impl=impl.REENTRANT if checkpointing.endswith("reentrant") else impl.NO_REENTRANT,
        )
        torch_wrapper.apply_activation_checkpointing(
            model, checkpoint_wrapper_fn=wrap, check_fn=lambda module: isinstance(module, blocks)
        )
        model.config.use_cache = False  # (a cache would be written again when a block is recomputed)
        if uncarried(model):
            return left_to_stock(
                model, lambda: packed_grads(model, pack([list(SEQUENCES)], mask=False)[0])[0]
            )
    elif checkpointing is not None:
        if not model.supports_gradient_checkpointing:
            pytest.skip(f"{type(model).__name__} does not checkpoint")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": checkpointing == "reentrant"}
            )
    kwargs, spans = pack([list(SEQUENCES)], mask=False)
    loss, grads = packed_grads(model, kwargs)
    want_loss, want = sequence_grads(model, spans)
    assert abs(loss - want_loss) <= 1e-5
    assert relative(grads, want) <= 1e-4
    if checkpointing is None:
        with stock():
            try:
                stock_loss, stock_grads = packed_grads(model, kwargs)
            except RuntimeError:  # (xLSTM's own cache, written in place in a training step: on stock alone)
                return
        assert relative(stock_grads, want) > 1e-2, "stock's packed step is right here: the test shows nothing"


@pytest.mark.invariant("I8")
@pytest.mark.parametrize("checkpointing", [None, "checkpoint_wrapper reentrant"])
@pytest.mark.parametrize("arch", PARAMS)
def test_padded_training_step_is_the_rows_own(arch, checkpointing, fresh_warnings):
    """A left-padded training step (the padded rows' own loss and gradients: stock's state layers take
    in the pads before each row), checkpointed by torch's ``checkpoint_wrapper`` or not."""
    model = hybrid(arch, **NO_DROPOUT).train()
    if checkpointing is not None:
        from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as torch_wrapper

        blocks = type(_layers(model)[0])
        wrap = functools.partial(
            torch_wrapper.checkpoint_wrapper, checkpoint_impl=torch_wrapper.CheckpointImpl.REENTRANT
        )
        torch_wrapper.apply_activation_checkpointing(
            model, checkpoint_wrapper_fn=wrap, check_fn=lambda m: isinstance(m, blocks)
        )
        model.config.use_cache = False
    rows = [list(seq) for seq in SEQUENCES]
    width = max(len(r) for r in rows)
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    labels = torch.where(mask == 1, ids, -100)
    labels[torch.arange(len(rows)), torch.tensor([width - len(r) for r in rows])] = -100  # (not from a pad)
    spans = [(r, width - len(row), tuple(row)) for r, row in enumerate(rows)]
    if checkpointing is not None and uncarried(model):
        return left_to_stock(
            model, lambda: model(input_ids=ids, attention_mask=mask, labels=labels).loss.item()
        )
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    want_loss, want = sequence_grads(model, spans)
    assert abs(out.loss.item() - want_loss) <= 1e-5
    assert relative(grads, want) <= 1e-4


@pytest.mark.parametrize("arch", PARAMS)
def test_unpadded_call_and_its_cache(arch):
    """``apply(unpad=True)``: a padded prompt runs on its real tokens alone (counted), its logits each row's
    own, and the cache it returns holds each row's state at its last real token: a decode step continues
    every row exactly, and greedy ``generate()`` gives each row the tokens it gets alone. xLSTM's call, which
    returns a cache of its own made at the call's batch size, stays padded (counted), exact alike."""
    model = hybrid(arch)
    packed_kept(model)  # (an unpadded call is a packed row)
    rows = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [15, 16, 17, 18]]
    width = max(len(r) for r in rows)
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])  # left-padded, as generate() takes them
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    name, given = cache_kwarg(model), first_cache(model)
    hfpatch.apply(unpad=True)
    try:
        calls, padded = hfpatch.status().unpadded["calls"], dict(hfpatch.status().unpadded["padded"])
        with torch.no_grad():
            out = model(
                input_ids=ids, attention_mask=mask, use_cache=True, **({name: given} if given else {})
            )
        counted = hfpatch.status().unpadded
        if arch == "xlstm":
            assert [why for why in counted["padded"] if counted["padded"][why] > padded.get(why, 0)] == [
                "a cache of its own to return (xLSTM's: made at the call's batch size, its states copied in)"
            ]
        else:
            assert counted["calls"] == calls + 1 and dict(counted["padded"]) == padded
        nxt = torch.tensor([[20], [21], [22]])
        with torch.no_grad():
            longer = torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], 1)
            cache = given if given is not None else output_cache(out)
            step = model(input_ids=nxt, attention_mask=longer, **{name: cache, "use_cache": True}).logits
        longer = [[*row, 20 + r] for r, row in enumerate(rows)]
        tolerance = max(
            tolerance_of(model, rows), 4 * split_noise(model, longer, [[len(r) for r in rows], [1, 1, 1]])
        )
        for r, row in enumerate(rows):
            assert (out.logits[r, width - len(row) :] - run_alone(model, row)).abs().max() <= tolerance
            assert (step[r, -1] - run_alone(model, [*row, 20 + r])[-1]).abs().max() <= tolerance
        with torch.no_grad():
            made = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
            for r, row in enumerate(rows):
                alone = model.generate(input_ids=torch.tensor([row]), max_new_tokens=4, do_sample=False)
                assert made[r, width:].tolist() == alone[0, len(row) :].tolist(), r
    finally:
        hfpatch.apply(unpad=False)


@pytest.mark.slow  # imports every mixer type's module: nox -s ci runs it
def test_status_keeps_their_packed_rows():
    for kind, arch in KINDS.items():
        if arch_skip_reason(arch) is None:
            module = importlib.import_module(REGISTRY[arch].module)
            said = hfpatch.status()[arch].packed
            keys = "keeps its keys" in said and TF < Version("5.4")  # (RecurrentGemma's attention, 4.x)
            takes = [
                cls
                for cls in vars(module).values()
                if isinstance(cls, type) and "ForCausalLM" in cls.__name__
            ]
            no_positions = not any(
                p.name == "position_ids" or p.kind is p.VAR_KEYWORD
                for cls in takes
                for p in inspect.signature(cls.forward).parameters.values()
            )  # (4.42-4.47's RWKV: no packed row can be passed)
            assert said.startswith("yes") or keys or (no_positions and "position_ids" in said), (
                kind,
                hfpatch.status()[arch],
            )
    assert TF  # (a release without any of them: nothing to say)


def test_a_first_call_of_one_token_starts_afresh():
    """RecurrentGemma's layers keep their state on themselves, and its one-token path continues it: a first
    call of one token (a cache passed empty, as its caller must) continues another run's state on stock;
    with hfpatch each row starts afresh (stepping on, each row gets what it gets alone)."""
    model = hybrid("recurrent_gemma")
    row, other = [5, 6, 7, 8], [30, 31, 32, 33, 34]

    def stepped() -> torch.Tensor:
        with torch.no_grad():
            model(input_ids=torch.tensor([other]))  # (another run: what the layers last held)
            cache, pieces = first_cache(model), []
            for token in row:
                out = model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True)
                pieces.append(out.logits[0])
        return torch.cat(pieces)

    assert (stepped() - run_alone(model, row)).abs().max() <= TOLERANCE
    with stock():
        wrong = (stepped() - run_alone(model, row)).abs().max()
    assert wrong > WRONG, "stock is right: the test shows nothing"


def test_an_attention_layer_no_call_writes_counts_what_a_written_one_holds():
    """5.18-5.22 make every layer of RecurrentGemma's cache an attention layer and read the cache's count on
    the first, which the model never writes (its recurrent block keeps its state on itself): from the
    model's first call on, that layer counts what the written one holds. (The model's own continued calls
    on those releases: test_padded_batches_split_into_cached_calls, in the release matrix.)"""
    from hfpatch.caches import recount_unwritten

    cache_utils = pytest.importorskip("transformers.cache_utils")  # (from 4.36)
    if not hasattr(cache_utils, "DynamicLayer"):
        pytest.skip(f"no cache layer objects in transformers {TF}")
    unwritten, written = cache_utils.DynamicLayer(), cache_utils.DynamicLayer()
    cache = types.SimpleNamespace(layers=[unwritten, written])
    recount_unwritten(cache)  # (a first call: nothing written, nothing to count)
    assert unwritten.get_seq_length() == 0
    keys = torch.zeros(1, 1, 5, 4)
    written.update(keys, keys)
    assert unwritten.get_seq_length() == 0  # (what stock reads there)
    recount_unwritten(cache)
    assert unwritten.get_seq_length() == 5
    written.update(keys[:, :, :1], keys[:, :, :1])
    assert unwritten.get_seq_length() == 6
