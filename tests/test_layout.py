"""A packed row at its sequences' own cost: its layout reaches the attention layers, never a
``length x length`` tensor. Every tensor a packed (or unpadded) call makes is recorded (a dispatch mode
sees each op's outputs): the largest is O(length) for SDPA and flex (their kernels tile the scores) and
the sequences' own ``heads x longest ** 2`` scores for eager, far under one ``length x length`` mask; each
sequence exact against itself alone. Compiled, a stream of packed rows of other lengths compiles a bounded
number of graphs."""

from __future__ import annotations

import warnings

import pytest
import torch
from packaging.version import Version
from test_packed import tensors_in
from torch.utils._python_dispatch import TorchDispatchMode

import hfpatch
from hfpatch.forward import STATES_COMPILED
from hfpatch.layout import Layout, grouped
from hfpatch.verification.tiny import tiny_config
from hfpatch.windows import mask_plan

from conftest import TF, arch_skip_reason, reverted
from expectations import MASKING_UTILS_FROM, PACKED_FROM
from harness import TOLERANCE, VOCAB

LENGTHS = (300, 41, 180, 257, 96, 1, 149, 256)  # 1,280 tokens in one row
HEADS = 4  # the tiny models'


class Largest(TorchDispatchMode):
    """The most elements of memory any tensor an op makes inside the block holds (its storage: a view
    of one element, as the placeholder mask is, holds one), and the op that made it."""

    def __init__(self) -> None:
        super().__init__()
        self.most, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(value, torch.Tensor) and value.device.type != "meta":
                held = value.untyped_storage().nbytes() // max(1, value.element_size())
                if held > self.most:
                    self.most, self.op = held, func
        return out


# where the layout reaches the attention, in a release that keeps the model's packed rows (PACKED_FROM):
# SDPA from the first (4.39-4.47's attention classes call it themselves), eager attention from 4.48 (the
# module's attention functions)
LAID_OUT_FROM = {"sdpa": "4.39", "eager": "4.48"}


def model_of(arch: str, attention: str, masking_utils: bool = False, **extra):
    import transformers

    if arch_skip_reason(arch):
        pytest.skip(arch_skip_reason(arch))
    since = max(Version(LAID_OUT_FROM.get(attention, "4.53")), Version(PACKED_FROM.get(arch, "0")))
    if masking_utils or attention not in LAID_OUT_FROM:
        since = max(since, Version(MASKING_UTILS_FROM.get(arch, "4.53")))
    if TF < since:
        pytest.skip(f"the layout reaches {arch}'s {attention} attention from {since}")
    sizes = {"attention_dropout": 0.0, "max_position_embeddings": 1024, "n_positions": 1024, **extra}
    config = tiny_config(arch, sizes)
    config._attn_implementation = attention
    torch.manual_seed(0)
    try:
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
    except (ValueError, ImportError) as exc:
        pytest.skip(f"{arch} with {attention} in transformers {TF}: {str(exc)[:80]}")
    said = hfpatch.status()[arch].packed
    if not said.startswith("yes"):  # (Mistral's on 4.39: its mask code takes no 4-D mask)
        pytest.skip(f"{arch}'s packed rows are not kept in transformers {TF}: {said}")
    return model


def rows_of(lengths=LENGTHS) -> list[list[int]]:
    generator = torch.Generator().manual_seed(sum(lengths))
    return [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def alone(model, row) -> torch.Tensor:
    with torch.no_grad(), hfpatch.unpatched():
        return model(input_ids=torch.tensor([row])).logits[0]


CASES = [
    ("llama", "sdpa", {}),
    ("llama", "eager", {}),
    ("gpt2", "sdpa", {}),
    ("mistral", "sdpa", {"sliding_window": 64}),
    ("mistral", "eager", {"sliding_window": 64}),
]


@pytest.mark.parametrize("layout", ["packed", "unpadded"])
@pytest.mark.parametrize("arch, attention, extra", CASES, ids=lambda v: v if isinstance(v, str) else "")
def test_no_tensor_is_length_by_length(arch, attention, extra, layout):
    model = model_of(arch, attention, **extra)
    rows = rows_of()
    total = sum(LENGTHS)
    with torch.no_grad():
        if layout == "packed":
            kwargs = {
                "input_ids": torch.tensor([sum(rows, [])]),
                "position_ids": torch.cat([torch.arange(n) for n in LENGTHS])[None],
            }
        else:  # right-padded rows, unpadded: one packed row of their real tokens
            width = max(LENGTHS)
            kwargs = {
                "input_ids": torch.tensor([row + [0] * (width - len(row)) for row in rows]),
                "attention_mask": torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows]),
            }
            hfpatch.apply(unpad=True)
        try:
            with Largest() as seen:
                out = model(**kwargs, use_cache=False)
        finally:
            hfpatch.apply(unpad=False)
    logits = out.logits
    assert {type(t) for t in tensors_in(out)} == {torch.Tensor}  # (never hfpatch's mask carrier)
    if layout == "packed":
        got = list(logits[0].split(list(LENGTHS)))
    else:
        got = [logits[r, : len(row)] for r, row in enumerate(rows)]
    for row, out in zip(rows, got):
        assert (out - alone(model, row)).abs().max() <= TOLERANCE
    # the sequences' own: eager scores a group of sequences of similar length together (at most 4 x their
    # own scores: lengths within a factor of 2), a window's mask alike; SDPA and flex tile them
    squares = 4 * sum(n * n for n in LENGTHS)
    own = HEADS * squares if attention == "eager" else squares if extra.get("sliding_window") else 0
    linear = total * max(model.config.vocab_size, getattr(model.config, "intermediate_size", 0) or 256)
    if layout == "unpadded":
        linear = max(linear, len(rows) * max(LENGTHS) * model.config.vocab_size)  # (its padded output)
    assert seen.most <= max(own, linear), (seen.most, seen.op, own, linear)
    assert seen.most < total * total  # (a mask of the row would be this much)


class Graphs:
    """A dynamo backend that counts the graphs it is given and the most elements any value of theirs
    holds (their traced example values: the custom op's inside aside), then runs each as it is."""

    def __init__(self) -> None:
        self.count, self.most = 0, 0

    def __call__(self, graph, inputs):
        self.count += 1
        for node in graph.graph.nodes:
            if node.op not in ("call_function", "call_method", "call_module"):
                continue  # (the inputs, the weights)
            value = node.meta.get("example_value")
            for tensor in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(tensor, torch.Tensor) and isinstance(tensor.numel(), int):
                    self.most = max(self.most, tensor.numel())
        return graph.forward


@pytest.mark.compile
@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_a_stream_of_packed_rows_compiles_two_graphs(arch):
    """torch.compile over packed rows of five other lengths: the first compiles a graph for its shape, the
    second one with a dynamic length, and no other compiles (the layout reaches the attention as data, for
    a custom op that runs the sequences: hfpatch.attention.sdpa_by_sequence); each sequence exact against
    itself alone, and nothing in the first graph as large as a mask of the row (Mistral: its window)."""
    model = model_of(arch, "sdpa", True, **({"sliding_window": 4} if arch == "mistral" else {}))
    torch._dynamo.reset()
    graphs = Graphs()
    compiled = torch.compile(model, fullgraph=True, backend=graphs)
    try:
        for lengths in ((50, 30, 90, 30), (7, 7), (2, 11, 4, 6), (12, 1), (3, 3, 3, 3, 3)):
            rows = rows_of(lengths)
            kwargs = {
                "input_ids": torch.tensor([sum(rows, [])]),
                "position_ids": torch.cat([torch.arange(n) for n in lengths])[None],
            }
            with torch.no_grad():
                logits = compiled(**kwargs).logits[0].split(list(lengths))
            for row, out in zip(rows, logits):
                assert (out - alone(model, row)).abs().max() <= TOLERANCE
            if graphs.count == 1:
                total = sum(lengths)
                assert graphs.most < total * total, graphs.most  # (the largest: the logits, 200 x 97)
    finally:
        torch._dynamo.reset()
    assert graphs.count <= 2, graphs.count


@pytest.mark.compile
def test_a_compiled_unpadded_call_holds_no_mask_of_its_real_tokens():
    """``torch.compile(model)`` under ``apply(unpad=True)``: right-padded rows of the lengths above run on
    their real tokens (each row's own logits, zeros at the pads), and no graph holds a value as large as a
    mask of the packed row (its real tokens squared): the packed call's SDPA runs by sequence in the op."""
    model = model_of("llama", "sdpa", True)
    rows = rows_of()
    width, total = max(LENGTHS), sum(LENGTHS)
    kwargs = {
        "input_ids": torch.tensor([row + [0] * (width - len(row)) for row in rows]),
        "attention_mask": torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows]),
    }
    torch._dynamo.reset()
    graphs = Graphs()
    hfpatch.apply(unpad=True)
    try:
        with torch.no_grad():
            logits = torch.compile(model, backend=graphs)(**kwargs, use_cache=False).logits
    finally:
        hfpatch.apply(unpad=False)
        torch._dynamo.reset()
    assert bool((logits[kwargs["attention_mask"] == 0] == 0).all())  # (run on the real tokens alone)
    for r, row in enumerate(rows):
        assert (logits[r, : len(row)] - alone(model, row)).abs().max() <= TOLERANCE
    assert 0 < graphs.most < total * total, graphs.most


@pytest.mark.compile
def test_a_compiled_call_reads_each_layer_types_layout_once(monkeypatch):
    """A compiled packed row of a model whose layer types alternate (sliding, full, sliding, full): the
    custom op reads each type's layout to the host once a call, however the types alternate, and the
    sequences are exact against themselves alone."""
    from hfpatch import compiled as route

    model = model_of(
        "gemma3_text", "sdpa", True, num_hidden_layers=4, sliding_window=3,
        layer_types=["sliding_attention", "full_attention"] * 2,
    )  # fmt: skip
    if getattr(model.config, "layer_types", None) != ["sliding_attention", "full_attention"] * 2:
        pytest.skip(f"gemma3_text takes no layer_types in transformers {TF}")
    if not mask_plan(type(model.model)).as_data:  # (4.57's module touches a mask: its multimodal model's)
        pytest.skip(f"gemma3's module touches the mask in transformers {TF}: compiled, its masks stay dense")
    reads = []
    monkeypatch.setattr(route, "grouped", lambda laid: reads.append(1) or grouped(laid))
    lengths = (9, 4, 12, 6)
    rows = rows_of(lengths)
    kwargs = {
        "input_ids": torch.tensor([sum(rows, [])]),
        "position_ids": torch.cat([torch.arange(n) for n in lengths])[None],
    }
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            logits = torch.compile(model, fullgraph=True, backend="eager")(**kwargs).logits[0]
    finally:
        torch._dynamo.reset()
    for row, out in zip(rows, logits.split(list(lengths))):
        assert (out - alone(model, row)).abs().max() <= TOLERANCE
    assert len(reads) == 2, len(reads)  # (one a layer type: was one a switch, 4 here)


# one of each kind a compiled packed row meets: layer types with windows, a window on every layer,
# a model whose layers touch the mask themselves (the dense masks: DeepSeek V3.2's indexer), and one whose
# state layers run by sequence in eager mode only (warned: compiled, its rows stay stock's)
COMPILED_KINDS = ["gemma3_text", "qwen2", "deepseek_v32", "bamba"]


@pytest.mark.compile
@pytest.mark.slow
@pytest.mark.parametrize("arch", COMPILED_KINDS)
def test_compiled_packed_rows_of_each_kind(arch, fresh_warnings):
    """A packed row under torch.compile(fullgraph=True): each sequence exact against itself alone on stock
    where its state layers (if any) can be kept, else the warning that says so, once."""
    from test_packed import SEQUENCES, pack, tiny, worst

    if arch_skip_reason(arch):
        pytest.skip(arch_skip_reason(arch))
    if TF < Version("4.53"):
        pytest.skip(
            "compiled packed rows reach the attention as data where mask functions hand masks on (4.53+)"
        )
    model = tiny(arch, "sdpa")
    kwargs, spans = pack([list(SEQUENCES)], mask=False)
    with (
        reverted(),
        torch.no_grad(),
    ):  # (stock's own code may not compile: Bamba's on 4.57 branches on a value)
        try:
            torch.compile(model, fullgraph=True, backend="eager")(**kwargs, use_cache=False)
        except torch._dynamo.exc.TorchDynamoException as exc:
            pytest.skip(f"stock transformers {TF} does not compile {arch} with fullgraph=True: {exc}"[:300])
        finally:
            torch._dynamo.reset()
    try:
        with torch.no_grad(), warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            logits = torch.compile(model, fullgraph=True, backend="eager")(**kwargs, use_cache=False).logits
    finally:
        torch._dynamo.reset()
    warned = [str(w.message) for w in said if str(w.message).startswith("hfpatch")]
    if arch == "bamba":
        assert len(warned) == 1 and STATES_COMPILED in warned[0], warned
        return
    assert not warned, warned
    assert worst(model, logits, spans) <= TOLERANCE


@pytest.mark.compile
@pytest.mark.inductor
@pytest.mark.slow
def test_a_compiled_packed_training_step_is_its_sequences_own():
    """A packed training step compiled by inductor (its backward too): the loss and every gradient those of
    the sequences run alone, each in a call of its own, on stock transformers."""
    model = model_of("llama", "sdpa", True)
    model.train()
    lengths = (5, 9, 3, 7)
    rows = rows_of(lengths)
    ids = torch.tensor([sum(rows, [])])
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = ids.clone()
    labels[0, torch.tensor((0, *lengths[:-1])).cumsum(0)] = -100  # (no token predicted across a boundary)
    with hfpatch.unpatched():
        model.zero_grad()
        total = sum(
            model(input_ids=torch.tensor([row]), labels=torch.tensor([row])).loss * (len(row) - 1)
            for row in rows
        )
        want_loss = total / sum(n - 1 for n in lengths)
        want_loss.backward()
        want = {n: p.grad.clone() for n, p in model.named_parameters()}
    torch._dynamo.reset()
    try:
        model.zero_grad()
        loss = torch.compile(model, fullgraph=True)(input_ids=ids, position_ids=positions, labels=labels).loss
        loss.backward()
    finally:
        torch._dynamo.reset()
    assert abs(loss.item() - want_loss.item()) <= TOLERANCE
    assert max((p.grad - want[n]).abs().max().item() for n, p in model.named_parameters()) <= TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("window", [None, 64])
def test_flex_attention_gets_its_block_mask_from_the_layout(window):
    """Flex attention (its kernel is a higher-order op a dispatch mode cannot see into): the packed row's
    ``BlockMask`` is built from the layout, its largest tensor the blocks' (``(length / 128) ** 2``); the
    sequences exact."""
    from hfpatch.windows import _block_mask

    model = model_of(
        "mistral" if window else "llama", "flex_attention", **({"sliding_window": window} if window else {})
    )
    rows = rows_of()
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([sum(rows, [])]), position_ids=positions).logits[0]
    for row, out in zip(rows, logits.split(list(LENGTHS))):
        assert (out - alone(model, row)).abs().max() <= TOLERANCE
    total = sum(LENGTHS)
    segment_ids = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS))[None]
    with Largest() as seen:
        _block_mask(torch.ones(1, total, dtype=torch.bool), positions, segment_ids, window, None)
    assert seen.most <= 4 * total, (seen.most, seen.op)


def test_the_attention_functions_are_the_modules_own():
    """The by-sequence SDPA reaches a patched module through an attention interface of its own: transformers'
    process-wide registry keeps its functions (a model hfpatch does not patch never meets hfpatch's), the
    module's interface is transformers' until its first packed call (a process that packs nothing pays
    nothing for it), its own from then while applied, and transformers' again after ``revert()``; a
    function a program sets on transformers' interface after ``apply()`` reaches the patched module's calls
    as it would without hfpatch (every entry is read at each call)."""
    if TF < Version("4.48"):
        pytest.skip(f"no attention functions before 4.48 (installed {TF})")
    import importlib

    from transformers import modeling_utils

    registry = modeling_utils.ALL_ATTENTION_FUNCTIONS
    module = importlib.import_module("transformers.models.llama.modeling_llama")
    before = registry["sdpa"]
    hfpatch.revert()
    assert module.ALL_ATTENTION_FUNCTIONS is registry
    hfpatch.apply()
    model = model_of("llama", "sdpa")  # (imports and patches the module)
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7]]))
    assert module.ALL_ATTENTION_FUNCTIONS is registry  # (no packed call yet)
    calls = []

    def spy(*args, **kwargs):
        calls.append(args[4] is None or type(args[4]).__name__)
        return before(*args, **kwargs)

    rows = rows_of((5, 3))
    kwargs = {
        "input_ids": torch.tensor([sum(rows, [])]),
        "position_ids": torch.cat([torch.arange(len(row)) for row in rows])[None],
    }
    registry["sdpa"] = spy
    try:
        with torch.no_grad():
            padded = model(input_ids=torch.tensor([rows[0]])).logits  # no packed row: the spy, as it is
            assert calls and "Carrier" not in calls, calls
            calls.clear()
            packed = model(**kwargs).logits  # a packed row: by sequence over the spy
            assert module.ALL_ATTENTION_FUNCTIONS is not registry and registry["sdpa"] is spy
    finally:
        registry["sdpa"] = before
    assert calls and "Carrier" not in calls, calls  # (each group's own mask, never the carrier)
    assert (padded[0] - alone(model, rows[0])).abs().max() <= TOLERANCE
    for got, row in zip(packed[0].split([len(row) for row in rows]), rows):
        assert (got - alone(model, row)).abs().max() <= TOLERANCE
    hfpatch.revert()
    try:
        assert module.ALL_ATTENTION_FUNCTIONS is registry
    finally:
        hfpatch.apply()


@pytest.mark.parametrize("window, chunk", [(None, None), (3, None), (None, 4)])
def test_a_compiled_layouts_dense_fallback_is_the_eager_layouts_mask(window, chunk):
    """Where the compiled op cannot take a call (attention weights asked for, dropout), SDPA gets the dense
    mask the compiled layout stands for: the eager layout's own, window and chunk by position alike."""
    from hfpatch.attention import ByLayout, _dense_of, compiled_layout
    from hfpatch.positions import segments

    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1], [*range(12), 0, 0, 0, 0]])
    real = torch.ones(2, 16, dtype=torch.bool)
    real[1, 12:] = False
    segment_ids = segments(positions, real.long())
    eager = ByLayout(grouped(Layout(real, positions, segment_ids, (real, segment_ids))), window, chunk)
    assert torch.equal(_dense_of(compiled_layout(real, segment_ids, positions, window, chunk)), eager.dense())
