"""Training through hfpatch: a padded batch's loss and gradients equal the sums of each row's own, run
alone and unpadded on stock transformers, with and without activation checkpointing (reentrant or not),
whoever checkpoints the layers: transformers' ``gradient_checkpointing_enable()``, torch's
``checkpoint_wrapper`` (as FSDP activation checkpointing and accelerate's FSDP plugin wrap each block),
or a plain ``torch.utils.checkpoint.checkpoint`` of each block's forward.

Checkpointing recomputes a layer in the backward pass, after the forward call that set hfpatch's call
context has returned: what the layer reads from the call (T5's per-row relative bias, handed to its first
layer) must be the same then, or the recomputed layer differs from the one the forward ran (a
``CheckpointError``, a shape error, or silently wrong gradients with reentrant checkpointing).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import pytest
import torch
import torch.utils.checkpoint

import hfpatch
from hfpatch.declarations import RELATIVE_BIAS as RELATIVE
from hfpatch.verification.tiny import tiny_model, tiny_seq2seq

from conftest import REGISTRY, TF, arch_skip_reason
from harness import PAD, WRONG, random_rows

# one model type of each way positions enter a model: absolute, rotary, a position table (BART), a table
# past the pad id (M2M100), T5's relative bias (its first layer: inside a checkpointed layer), Whisper's
# decoder positions
FAMILIES = ["gpt2", "llama", "bart", "m2m_100", "t5", "whisper"]
NO_DROPOUT = {
    "dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0, "dropout_rate": 0.0,
    "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
}  # fmt: skip
# who checkpoints the blocks, and how: transformers' own function (reentrant or not), torch's
# checkpoint_wrapper (both), a plain torch.utils.checkpoint of each block's forward (non-reentrant: the
# reentrant one takes no keyword arguments, which every block is called with)
MODES = {
    "none": None,
    "reentrant": ("transformers", True),
    "non-reentrant": ("transformers", False),
    "checkpoint_wrapper reentrant": ("checkpoint_wrapper", True),
    "checkpoint_wrapper non-reentrant": ("checkpoint_wrapper", False),
    "checkpoint of each block": ("checkpoint", False),
}
ROWS = random_rows([3, 6], seed=5)
TARGETS = random_rows([3, 6], seed=6)
# how the rows are padded into one batch (one call, no cache): row 0 on the left; or each row with a pad
# inside it (a hole after its first two tokens, as a ragged or packed batch has), which stock gets wrong
# for every family; or one row alone with a hole (where a recomputed layer that differs in shape raises
# with two rows, it is silently wrong with one)
LAYOUTS = ("left", "hole", "hole, one row")


def _model(arch: str) -> Any:
    if arch_skip_reason(arch):
        pytest.skip(arch_skip_reason(arch))
    if REGISTRY[arch].family.seq2seq:
        model = tiny_seq2seq(arch, attention="eager", **NO_DROPOUT)
    else:
        model = tiny_model(arch, attention="eager", sizes=NO_DROPOUT)
    return model.train()  # checkpointing runs in training mode only; no dropout here, so it is exact


def _padded(rows: list[list[int]], layout: str) -> tuple[list[list[int]], list[list[int]]]:
    """(ids, mask) of ``rows`` padded into one batch; each row's real tokens keep their order."""
    if layout.startswith("hole"):
        rows = [row[:2] + [PAD] + row[2:] for row in rows]
    width = max(len(row) for row in rows)
    ids, mask = [], []
    for row in rows:
        pads = width - len(row)
        real = [0 if layout.startswith("hole") and i == 2 else 1 for i in range(len(row))]
        ids.append([PAD] * pads + row if layout == "left" else row + [PAD] * pads)
        mask.append([0] * pads + real if layout == "left" else real + [0] * pads)
    return ids, mask


def _inputs(model: Any, ids: list[list[int]], mask: list[list[int]]) -> dict[str, torch.Tensor]:
    if not model.config.is_encoder_decoder:
        return {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask)}
    return {
        model.main_input_name: _encoder_input(model, len(ids)),
        "decoder_input_ids": torch.tensor(ids),
        "decoder_attention_mask": torch.tensor(mask),
    }


def _encoder_input(model: Any, rows: int) -> torch.Tensor:
    """The same unpadded encoder input for every row (token ids, or Whisper's mel features)."""
    generator = torch.Generator().manual_seed(0)
    if model.main_input_name == "input_ids":
        return torch.randint(3, 90, (1, 5), generator=generator).expand(rows, 5)
    config = model.config
    shape = (1, config.num_mel_bins, 2 * config.max_source_positions)
    return torch.randn(*shape, generator=generator).expand(rows, *shape[1:])


def _loss_and_grads(model: Any, rows: list, layout: str = "left") -> tuple[float, list[torch.Tensor]]:
    """The summed cross entropy of every real token against its target, and the gradients."""
    model.zero_grad(set_to_none=True)
    ids, mask = _padded(rows, layout)
    logits = model(**_inputs(model, ids, mask), use_cache=False).logits
    loss = logits.new_zeros(())
    for r, row in enumerate(rows):
        real = torch.tensor(mask[r]).nonzero().flatten()
        target = torch.tensor(TARGETS[ROWS.index(row)])
        loss = loss + torch.nn.functional.cross_entropy(logits[r, real], target, reduction="sum")
    loss.backward()
    grads = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    return loss.item(), grads


def _reference(model: Any, rows: list) -> tuple[float, list[torch.Tensor]]:
    """Each row alone, unpadded, on stock transformers, without checkpointing: the sums."""
    loss, grads = 0.0, None
    with hfpatch.unpatched():
        for row in rows:
            one, row_grads = _loss_and_grads(model, [row])
            loss += one
            grads = row_grads if grads is None else [a + b for a, b in zip(grads, row_grads)]
    return loss, grads


def _blocks(model: Any) -> list[Any]:
    """The model's blocks: the members of each stack's list of layers."""
    lists = [getattr(m, name, None) for m in model.modules() for name in ("layers", "h", "block")]
    return [block for blocks in lists if isinstance(blocks, torch.nn.ModuleList) for block in blocks]


def _checkpointing(model: Any, who: str, reentrant: bool) -> None:
    """Activation checkpointing of every block by ``who``, reentrant or not (transformers' own: the
    choice needs 4.35+; before, reentrant only)."""
    if who == "checkpoint_wrapper":
        from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as torch_wrapper

        impl = torch_wrapper.CheckpointImpl
        impl = impl.REENTRANT if reentrant else impl.NO_REENTRANT
        blocks = {id(block) for block in _blocks(model)}
        torch_wrapper.apply_activation_checkpointing(
            model,
            checkpoint_wrapper_fn=functools.partial(torch_wrapper.checkpoint_wrapper, checkpoint_impl=impl),
            check_fn=lambda module: id(module) in blocks,
        )
        return
    if who == "checkpoint":
        for block in _blocks(model):
            checkpoint = torch.utils.checkpoint.checkpoint
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
        return
    if "gradient_checkpointing_kwargs" in inspect.signature(model.gradient_checkpointing_enable).parameters:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    elif reentrant:
        model.gradient_checkpointing_enable()  # torch's default then: reentrant
    else:
        pytest.skip(f"gradient_checkpointing_enable() takes no use_reentrant in transformers {TF} (4.35+)")


def _worst(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """The largest gradient difference, relative to the largest gradient."""
    scale = max(x.abs().max().item() for x in b)
    return max((x - y).abs().max().item() for x, y in zip(a, b)) / scale


def _skip_if_stock_fails(model: Any, rows: list, layout: str, patched_error: RuntimeError) -> None:
    """Skip, saying so, when stock transformers fails the same training step with the same error (Whisper
    with reentrant checkpointing on 4.57.6: "backward through the graph a second time")."""
    try:
        with hfpatch.unpatched():
            _loss_and_grads(model, rows, layout)
    except RuntimeError as stock_error:
        if str(stock_error).split(".")[0] == str(patched_error).split(".")[0]:
            pytest.skip(f"stock transformers {TF} fails this step too: {str(stock_error).split('.')[0]}")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("arch", FAMILIES)
def test_padded_batch_trains_as_its_rows_alone(arch, mode, layout):
    model = _model(arch)
    rows = ROWS[:1] if layout == "hole, one row" else ROWS
    loss_ref, grads_ref = _reference(model, rows)
    if layout.startswith("hole") and REGISTRY[arch].family.hands_to != "padded table":  # stock is wrong here
        # (M2M100's table counts the ids that are not the pad id: a pad in a hole is right on stock)
        with hfpatch.unpatched():
            stock_loss, stock_grads = _loss_and_grads(model, rows, layout)
        assert _worst(stock_grads, grads_ref) > WRONG, f"{arch}: stock is right with a hole"
    if MODES[mode] is not None:
        _checkpointing(model, *MODES[mode])
    try:
        loss, grads = _loss_and_grads(model, rows, layout)
    except RuntimeError as patched_error:
        _skip_if_stock_fails(model, rows, layout, patched_error)
        raise
    assert abs(loss - loss_ref) <= 1e-5 * abs(loss_ref), (loss, loss_ref)
    worst = _worst(grads, grads_ref)
    assert worst <= 1e-5, f"{arch} ({mode}, {layout}): gradients off by {worst:.2e} of the largest"


RELATIVE_BIAS = sorted(arch for arch, adapter in REGISTRY.items() if adapter.family.hands_to == RELATIVE)


@pytest.mark.parametrize("mode", ["checkpoint_wrapper reentrant", "checkpoint_wrapper non-reentrant"])
@pytest.mark.parametrize("arch", [a for a in RELATIVE_BIAS if a != "t5"])  # T5 above, in every mode
def test_every_relative_bias_type_trains_as_its_rows_alone_under_torchs_wrapper(arch, mode):
    model = _model(arch)
    loss_ref, grads_ref = _reference(model, ROWS)
    _checkpointing(model, *MODES[mode])
    loss, grads = _loss_and_grads(model, ROWS, "hole")
    assert abs(loss - loss_ref) <= 1e-5 * abs(loss_ref), (loss, loss_ref)
    worst = _worst(grads, grads_ref)
    assert worst <= 1e-5, f"{arch} ({mode}): gradients off by {worst:.2e} of the largest"
