"""Packed rows (I9): several sequences in one row, their positions restarting, as
``DataCollatorWithFlattening`` and TRL's ``padding_free`` make them. With hfpatch, every real token gets
the logits of its sequence run alone, unpadded, on stock transformers (harness.run_alone), and a packed
training step the loss and gradients of its sequences alone; without a mask, with an all-ones or padded
mask, with the empty cache ``use_cache`` makes or none, the sequences given by their lengths; eager,
SDPA and (4.53+) flex attention. Where a release cannot keep a model's packed rows (expectations.
PACKED_FROM), the call stays stock's, bit for bit, and says so once. A row whose positions never
restart stays stock's bits."""

from __future__ import annotations

import functools
import inspect
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from packaging.version import Version
from test_unchanged import same_as_stock

import hfpatch
from hfpatch import _context

from conftest import REGISTRY, TF, make_dynamic_cache, spying, stock
from expectations import PACKED_FROM
from harness import TOLERANCE, VOCAB, WRONG, cache_kwarg, run_alone

pytestmark = pytest.mark.invariant("I9")

SEQUENCES = ((5, 6, 7, 8, 9, 10), (11, 12, 13), (14, 15, 16, 17, 18))
# train mode with dropout off: the sequences alone are the reference
NO_DROPOUT = {
    name: 0.0
    for name in ("resid_pdrop", "embd_pdrop", "attn_pdrop", "attention_dropout", "hidden_dropout", "dropout")
}


def kept_here(arch: str) -> bool:
    """Whether this release keeps ``arch``'s packed rows (measured: expectations.PACKED_FROM)."""
    return TF >= Version(PACKED_FROM[arch])


def pack(rows: list[list[tuple[int, ...]]], mask: bool, pad: int = 0) -> tuple[dict, list]:
    """``rows`` of sequences packed into a batch: ``input_ids``, ``position_ids`` restarting at each
    sequence, right padding to the longest row (pads at position 0), and an ``attention_mask`` where
    ``mask``; with the (row, first column, sequence) of each sequence."""
    width = max(sum(len(s) for s in row) for row in rows)
    ids, positions, real, spans = [], [], [], []
    for r, row in enumerate(rows):
        column, line, where = 0, [], []
        for sequence in row:
            spans.append((r, column, sequence))
            line += list(sequence)
            where += list(range(len(sequence)))
            column += len(sequence)
        ids.append(line + [pad] * (width - column))
        positions.append(where + [0] * (width - column))
        real.append([1] * column + [0] * (width - column))
    kwargs = {"input_ids": torch.tensor(ids), "position_ids": torch.tensor(positions)}
    if mask:
        kwargs["attention_mask"] = torch.tensor(real)
    return kwargs, spans


def worst(model, logits: torch.Tensor, spans: list) -> float:
    """Largest |logit difference| of any packed sequence from the sequence alone, on stock."""
    return max(
        (logits[r, start : start + len(seq)] - run_alone(model, seq)).abs().max().item()
        for r, start, seq in spans
    )


def tiny(arch: str, attention: str, **sizes):
    from hfpatch.verification.tiny import tiny_model

    try:
        return tiny_model(arch, attention=attention, sizes=sizes or None)
    except (ValueError, ImportError) as exc:
        pytest.skip(f"{arch} with {attention} attention in transformers {TF}: {str(exc)[:150]}")


@pytest.fixture(params=["eager", "sdpa"])
def attention(request) -> str:
    return request.param


LAYOUTS = {
    # DataCollatorWithFlattening's batch: one row, no mask, positions restarting
    "no mask": ([list(SEQUENCES)], False, {}),
    "no mask, use_cache=False": ([list(SEQUENCES)], False, {"use_cache": False}),  # transformers' own path
    "an all-ones mask": ([list(SEQUENCES)], True, {}),  # what many trainers pass
    "two right-padded rows": ([list(SEQUENCES[:2]), [SEQUENCES[2], (20, 21)]], True, {}),
    "an empty cache passed": ([list(SEQUENCES)], False, {"cache": "empty"}),
}


def run_layout(model, name: str, train: bool = False):
    rows, mask, extra = LAYOUTS[name]
    kwargs, spans = pack(rows, mask)
    if extra.get("cache") == "empty":
        if not hasattr(__import__("transformers"), "DynamicCache"):
            pytest.skip(f"no Cache objects in transformers {TF}")
        extra = {cache_kwarg(model): make_dynamic_cache(model), "use_cache": True}
    model.train(train)
    try:
        with torch.no_grad():
            out = model(**kwargs, **extra)
    finally:
        model.eval()
    kinds = {type(t).__name__ for t in tensors_in(out)}
    assert kinds <= {"Tensor", "Parameter"}, f"{name}: the outputs hold {kinds}"  # (never hfpatch's carrier)
    return out.logits, spans, kwargs


def tensors_in(value, depth: int = 0):
    """Every tensor an output holds: its fields, their tuples and lists, a cache's layers (their attributes),
    a few levels down."""
    if isinstance(value, torch.Tensor):
        yield value
    elif depth < 5 and isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item, depth + 1)
    elif depth < 5 and isinstance(value, (tuple, list)):
        for item in value:
            yield from tensors_in(item, depth + 1)
    elif depth < 5 and hasattr(value, "__dict__") and not isinstance(value, (type, torch.nn.Module)):
        for item in vars(value).values():
            yield from tensors_in(item, depth + 1)


@pytest.mark.parametrize("asked", ["output_hidden_states", "output_attentions", "output_attentions=True"])
@pytest.mark.parametrize("layout", ["two right-padded rows"])  # (a mask, rows, sequences of several lengths)
def test_outputs_the_config_asks_for_are_each_sequences_own(arch, attention, layout, asked):
    """A packed row of a model whose config asks for hidden states or attention weights (as a trainer's
    or a pipeline's config may, not the call; attention weights by the call's keyword too): every output
    a plain tensor; each sequence's logits and last hidden states those of the sequence alone (stock);
    eager attention's weights, each sequence's block of them its own alone and nothing outside it (zeros:
    no sequence attends to another). GPT-2's eager attention before 5.0 is not told that weights
    are asked for: its packed rows' weights came back None."""
    if not kept_here(arch):
        pytest.skip(f"{arch}'s packed rows are kept from {PACKED_FROM[arch]} (installed {TF})")
    name, keyword = asked.partition("=")[0], "=" in asked  # (or asked for by the call's keyword)
    if name == "output_attentions" and attention != "eager":
        # (5.x refuses; 4.x falls back to eager attention, 4.40's without its causal mask on stock)
        pytest.skip("attention weights are eager attention's")
    model = tiny(arch, attention)
    if not keyword:
        setattr(model.config, name, True)
    rows, mask, extra = LAYOUTS[layout]
    extra = {**extra, name: True} if keyword else extra
    kwargs, spans = pack(rows, mask)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = model(**kwargs, **extra)
            alone = {}
            with stock():
                for _, _, seq in spans:
                    ids = torch.tensor([list(seq)])
                    alone[seq] = model(input_ids=ids, **({name: True} if keyword else {}))
    finally:
        setattr(model.config, name, False)
    kinds = {type(t).__name__ for t in tensors_in(out)}
    assert kinds <= {"Tensor", "Parameter"}, kinds
    assert worst(model, out.logits, spans) <= TOLERANCE
    if any((alone[seq].logits[0] - run_alone(model, seq)).abs().max() > TOLERANCE for _, _, seq in spans):
        # (4.40's Llama built with SDPA classes: asked for weights, it falls back to eager attention without
        # its causal mask)
        pytest.skip(f"stock {TF}: a sequence alone asked for {name} is not its run without: no reference")
    for r, start, seq in spans:
        columns = slice(start, start + len(seq))
        if name == "output_hidden_states":
            got, want = out.hidden_states[-1][r, columns], alone[seq].hidden_states[-1][0]
            assert (got - want).abs().max().item() <= TOLERANCE
        else:
            assert out.attentions is not None and alone[seq].attentions is not None
            for got, want in zip(out.attentions, alone[seq].attentions, strict=True):
                assert (got[r, :, columns, columns] - want[0]).abs().max().item() <= TOLERANCE
                outside = got[r, :, columns].clone()
                outside[..., columns] = 0
                assert outside.abs().max().item() == 0.0


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_packed_sequence_gets_its_own_logits(arch, attention, layout):
    model = tiny(arch, attention)
    if kept_here(arch):
        logits, spans, _ = run_layout(model, layout)
        assert worst(model, logits, spans) <= TOLERANCE
        assert type(logits) is torch.Tensor  # (not hfpatch's mask carrier: an attention may meet it itself)
        # (no mask and no cache: transformers' own packed rows, masking_utils' from 4.53, are exact there)
        if layout != "no mask, use_cache=False" or TF < Version("4.53"):
            with stock():
                wrong, _, _ = run_layout(model, layout)
            assert worst(model, wrong, spans) > WRONG, "stock is right here: the test shows nothing"
    else:  # stock's result, or stock's error (a release that takes no Cache object), alike
        same_as_stock(lambda: [run_layout(model, layout)[0]])


def test_train_mode_and_labels(arch, attention):
    """The collator's batch as Trainer hands it over: train mode, labels (-100 at each sequence's first
    token), no mask; dropout off so that the sequences alone are the reference."""
    if not kept_here(arch):
        pytest.skip(f"packed rows of {arch} are kept from {PACKED_FROM[arch]} (installed {TF})")
    model = tiny(arch, attention, **NO_DROPOUT)
    logits, spans, _ = run_layout(model, "no mask", train=True)
    assert worst(model, logits, spans) <= TOLERANCE


def sequence_grads(model, spans) -> tuple[float, dict]:
    """The loss and gradients of the sequences alone, each weighted as its share of the packed tokens."""
    total = sum(len(seq) - 1 for _, _, seq in spans)
    model.zero_grad(set_to_none=True)
    loss = 0.0
    with stock():
        for _, _, seq in spans:
            out = model(input_ids=torch.tensor([seq]), labels=torch.tensor([seq]))
            (out.loss * (len(seq) - 1) / total).backward()
            loss += out.loss.item() * (len(seq) - 1) / total
    return loss, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def packed_grads(model, kwargs) -> tuple[float, dict]:
    labels = kwargs["input_ids"].clone()
    labels[kwargs["position_ids"] == 0] = -100  # each sequence's first token has no label
    model.zero_grad(set_to_none=True)
    out = model(**kwargs, labels=labels)
    out.loss.backward()
    return out.loss.item(), {
        name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None
    }


def relative(got: dict, want: dict) -> float:
    return max(((got[k] - want[k]).norm() / want[k].norm().clamp(min=1e-12)).item() for k in want)


CHECKPOINTING = [None, "reentrant", "non-reentrant", "checkpoint_wrapper", "checkpoint_wrapper reentrant"]


@pytest.mark.invariant("I8")
@pytest.mark.parametrize("checkpointing", CHECKPOINTING)
def test_packed_training_step_is_the_sequences_own(arch, attention, checkpointing):
    if not kept_here(arch):
        pytest.skip(f"packed rows of {arch} are kept from {PACKED_FROM[arch]} (installed {TF})")
    model = tiny(arch, attention, **NO_DROPOUT).train()
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
        model.config.use_cache = False  # a cache would be written again when a block is recomputed
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
    if checkpointing is None:  # (transformers' checkpointing turns the cache off: 4.57+ detects the packing)
        with stock():
            _, stock_grads = packed_grads(model, kwargs)
        assert relative(stock_grads, want) > 1e-2, "stock's packed step is right here: the test shows nothing"


def _layers(model):
    return next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList))


def test_sequences_given_by_their_lengths(arch, attention):
    """The collator's ``return_flash_attn_kwargs=True`` (``cu_seq_lens_*``) or ``return_seq_idx=True``
    batch without ``position_ids``: positions count from 0 in each sequence."""
    if not kept_here(arch):
        pytest.skip(f"packed rows of {arch} are kept from {PACKED_FROM[arch]} (installed {TF})")
    import transformers

    collator = getattr(transformers, "DataCollatorWithFlattening", None)
    model = tiny(arch, attention)
    features = [{"input_ids": list(seq)} for seq in SEQUENCES]
    spans = [(0, sum(len(s) for s in SEQUENCES[:i]), seq) for i, seq in enumerate(SEQUENCES)]
    for options in ({"return_flash_attn_kwargs": True}, {"return_seq_idx": True}):
        try:
            batch = collator(return_position_ids=False, **options)(features)
        except TypeError as exc:  # older collators: no such option
            pytest.skip(f"DataCollatorWithFlattening of transformers {TF}: {exc}")
        batch.pop("labels")
        try:
            with spying(model) as seen, torch.no_grad():
                model(**batch)
        except TypeError as exc:
            pytest.skip(f"{type(model).__name__} takes no {sorted(batch)} in transformers {TF}: {exc}")
        # (a head that drops the lengths, 4.57's GPT-2: hfpatch turns them into positions before it)
        if not any(seen[-1].get(name) is not None for name in ("cu_seq_lens_q", "seq_idx", "position_ids")):
            pytest.skip(f"{type(model).__name__} does not hand {sorted(batch)} to its base model in {TF}")
        with torch.no_grad():
            assert worst(model, model(**batch).logits, spans) <= TOLERANCE, options


@pytest.mark.slow
def test_flex_attention(arch):
    if TF < Version("4.53"):
        pytest.skip(f"flex attention takes hfpatch's BlockMask from 4.53 (installed {TF})")
    model = tiny(arch, "flex_attention")
    for layout in ("no mask", "two right-padded rows"):
        logits, spans, _ = run_layout(model, layout)
        assert worst(model, logits, spans) <= TOLERANCE, layout


def test_windows_by_position_inside_each_sequence():
    """Mistral with a window of 4 and sequences longer than it: each sequence alone has its window."""
    if "mistral" not in __import__("conftest").SEQ2SEQ_MODEL_TYPES and TF < Version("4.34"):
        pytest.skip(f"no Mistral in transformers {TF}")
    from hfpatch.verification.tiny import tiny_config

    from harness import windowed_model

    for attention in ("eager", "sdpa"):
        model = windowed_model("mistral", tiny_config("mistral", {"sliding_window": 4}), attention)
        if not hfpatch.status()["mistral"].packed.startswith("yes"):
            pytest.skip(f"Mistral's packed rows are not kept in transformers {TF}")
        kwargs, spans = pack([[tuple(range(3, 12)), tuple(range(20, 27)), (30, 31)]], mask=True)
        with torch.no_grad():
            assert worst(model, model(**kwargs).logits, spans) <= TOLERANCE, attention


# --- what stays stock's ------------------------------------------------------------------------------


def test_positions_that_never_restart_stay_stock_bits(model):
    """A padded batch with positions given, as generate() gives them (pads repeating a position): no
    sequence starts inside a row, so the call is stock's, bit for bit."""
    ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    for positions in ([[1, 1, 0, 1, 2], [0, 1, 2, 3, 4]], [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]):
        kwargs = {"input_ids": ids, "attention_mask": mask, "position_ids": torch.tensor(positions)}
        with torch.no_grad():
            assert same_as_stock(lambda kwargs=kwargs: [model(**kwargs).logits]) == "ok"


def test_the_callers_positions_reach_the_model_unchanged(model):
    kwargs, _ = pack([list(SEQUENCES)], mask=False)
    with spying(model) as seen, torch.no_grad():
        model(**kwargs)
    assert seen[-1]["position_ids"] is kwargs["position_ids"]


def test_the_switch_leaves_packed_rows_to_stock(model):
    kwargs, _ = pack([list(SEQUENCES)], mask=True)
    hfpatch.apply(packed=False)
    try:
        with torch.no_grad():
            assert same_as_stock(lambda: [model(**kwargs).logits]) == "ok"
    finally:
        hfpatch.apply(packed=True)


def test_status_says_where_packed_rows_are_kept(arch):
    import importlib

    importlib.import_module(REGISTRY[arch].module)
    packed = hfpatch.status()[arch].packed
    assert packed.startswith("yes") == kept_here(arch), packed
    assert hfpatch.status()["mpt"].packed.startswith("no")


def test_not_kept_warns_once_and_runs_as_stock(arch, fresh_warnings):
    if kept_here(arch):
        pytest.skip(f"packed rows of {arch} are kept here ({TF})")
    model = tiny(arch, "eager")
    kwargs, _ = pack([list(SEQUENCES)], mask=False)
    with pytest.warns(RuntimeWarning, match="not kept to its sequences"), torch.no_grad():
        model(**kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            model(**kwargs)  # said once


def test_recurrent_blocks_are_declared(fresh_warnings):
    """RecurrentGemma before 5.4: its attention keeps its keys on itself, where no mask by sequence
    reaches them: hfpatch says so and leaves a packed call to stock (from 5.4 its packed rows are kept:
    tests/test_mixers.py)."""
    if TF < Version("4.40") or TF >= Version("5.4"):
        pytest.skip(f"RecurrentGemma's packed rows are not declared left to stock in transformers {TF}")
    model = tiny("recurrent_gemma", "eager")
    assert hfpatch.status()["recurrent_gemma"].packed.startswith("no: its attention keeps its keys")
    if "position_ids" not in inspect.signature(type(model).forward).parameters:
        pytest.skip(f"{type(model).__name__} takes no position_ids in transformers {TF}")
    kwargs, _ = pack([list(SEQUENCES)], mask=False)
    with spying(model) as seen, torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model(**kwargs)
    if "position_ids" not in seen[-1]:
        pytest.skip(f"{type(model).__name__} hands no position_ids to its base model in transformers {TF}")
    _context.WARNED.clear()  # (the look above was warned of)
    with pytest.warns(RuntimeWarning, match="keeps its keys on itself"):
        assert same_as_stock(lambda: [model(**kwargs).logits]) == "ok"


def test_packed_argument_is_checked():
    with pytest.raises(TypeError, match="packed"):
        hfpatch.apply(packed="no")


@pytest.mark.compile
def test_compiled_packed_row_has_no_graph_break(arch):
    """torch.compile(fullgraph=True) of a packed forward: one graph, no break, the sequences' logits (the
    look for restarts makes no branch on tensor values there)."""
    from torch._dynamo.testing import CompileCounter

    if not kept_here(arch):
        pytest.skip(f"packed rows of {arch} are kept from {PACKED_FROM[arch]} (installed {TF})")
    # measured: dynamo's "data-dependent branching" at `cache_position[0]` (before 4.42), at
    # `if attention_mask.max() != 0` (4.41-4.43), in transformers' own mask code given any 4-D mask
    if TF < Version("4.44"):
        pytest.skip(f"the mask code of {TF} branches on a tensor's value when given any 4-D mask")
    model = tiny(arch, "sdpa")
    kwargs, spans = pack([list(SEQUENCES)], mask=False)
    torch._dynamo.reset()
    counter = CompileCounter()
    try:
        with torch.no_grad():
            logits = torch.compile(model, fullgraph=True, backend=counter)(**kwargs).logits
    finally:
        torch._dynamo.reset()
    assert counter.frame_count == 1
    assert worst(model, logits, spans) <= TOLERANCE


@st.composite
def packed_layouts(draw):
    rows = draw(st.integers(1, 2))
    layout = []
    for _ in range(rows):
        count = draw(st.integers(1, 4))
        layout.append(
            [tuple(draw(st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=5))) for _ in range(count)]
        )
    return layout, draw(st.booleans())


@given(packed_layouts())
def test_any_packing(model, drawn):
    rows, mask = drawn
    arch = model.config.model_type
    kwargs, spans = pack(rows, mask)
    with torch.no_grad():
        logits = model(**kwargs).logits
    if kept_here(arch):
        assert worst(model, logits, spans) <= TOLERANCE
    else:
        with stock(), torch.no_grad():
            assert torch.equal(model(**kwargs).logits, logits)


# --- models that take their positions from the mask, multimodal text models -----------------------

FROM_MASK = {"opt": "4.49", "bloom": "4.44"}  # their packed rows are kept from (first releases that can)


@pytest.mark.parametrize("arch", sorted(FROM_MASK))
def test_models_that_take_their_positions_from_the_mask(arch, fresh_warnings):
    """OPT (its table from the mask's cumsum, or the caller's positions) and BLOOM (ALiBi from the mask's
    cumsum; 5.x's heads drop the positions before the base model): right on stock with padding, so
    hfpatch changes no padded call; their packed rows, every layout and the collator's lengths, are kept
    to each sequence, where stock lets the sequences see each other."""
    if TF < Version(FROM_MASK[arch]):
        pytest.skip(f"{arch}'s packed rows are kept from {FROM_MASK[arch]} (installed {TF})")
    model = tiny(arch, "eager")
    assert hfpatch.status()[arch].state == "applied" and hfpatch.status()[arch].packed.startswith("yes")
    left = {"input_ids": torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]]),
            "attention_mask": torch.tensor([[0, 0, 1, 1, 1], [1] * 5])}  # fmt: skip
    with torch.no_grad():
        assert same_as_stock(lambda: [model(**left).logits]) == "ok"
    for layout in ("no mask", "an all-ones mask", "two right-padded rows"):
        logits, spans, _ = run_layout(model, layout)
        assert worst(model, logits, spans) <= TOLERANCE, layout
        with stock():
            wrong, _, _ = run_layout(model, layout)
        assert worst(model, wrong, spans) > WRONG, f"stock is right here ({layout}): the test shows nothing"
    collator = getattr(__import__("transformers"), "DataCollatorWithFlattening", None)
    try:
        batch = collator(return_position_ids=False, return_flash_attn_kwargs=True)(
            [{"input_ids": list(seq)} for seq in SEQUENCES]
        )
    except TypeError:  # older collators: no such option
        return
    batch.pop("labels")
    spans = [(0, sum(len(s) for s in SEQUENCES[:i]), seq) for i, seq in enumerate(SEQUENCES)]
    try:
        with torch.no_grad(), stock():
            model(**batch)
    except (TypeError, ValueError) as exc:  # a head that takes no lengths: stock raises, and so does this
        assert "cu_seq_lens" in str(exc) or "unexpected" in str(exc), exc
        return
    with torch.no_grad():
        assert worst(model, model(**batch).logits, spans) <= TOLERANCE


def test_every_status_entry_answers_packed():
    """``status()[type].packed`` is yes or no-with-why for every model type, patched or not, imported or
    not; after ``apply(packed=False)`` every one says no, and why."""
    for entry in hfpatch.status().values():
        assert entry.packed.startswith(("yes", "no: ")), (entry.arch, entry.packed)
    hfpatch.apply(packed=False)
    try:
        kept = [e for e in hfpatch.status().values() if not e.packed.startswith("no: ")]
        assert not kept, kept
        applied = [e for e in hfpatch.status().values() if e.state == "applied"]
        assert applied and all(e.packed.startswith("no: left to stock") for e in applied)
    finally:
        hfpatch.apply(packed=True)


def test_the_environment_variable_is_read_by_apply(monkeypatch, model):
    """``HFPATCH_PACKED=0`` means the same for a program's own ``hfpatch.apply()`` as for the launcher: the
    process's first apply() without ``packed=`` reads it (a bad value: ValueError naming it)."""
    from hfpatch import engine

    kwargs, _ = pack([list(SEQUENCES)], mask=True)
    monkeypatch.setattr(engine, "_environment_read", [])
    monkeypatch.setenv("HFPATCH_PACKED", "maybe")
    with pytest.raises(ValueError, match="HFPATCH_PACKED=maybe"):
        hfpatch.apply()
    monkeypatch.setenv("HFPATCH_PACKED", "0")
    try:
        hfpatch.apply()
        assert hfpatch.status()[model.config.model_type].packed.startswith("no: left to stock")
        with torch.no_grad():
            assert same_as_stock(lambda: [model(**kwargs).logits]) == "ok"
        hfpatch.apply()  # read once: a later apply() keeps what the program said since
        assert hfpatch.status()[model.config.model_type].packed.startswith("no")
    finally:
        hfpatch.apply(packed=True)
