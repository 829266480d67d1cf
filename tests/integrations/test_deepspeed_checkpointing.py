"""DeepSpeed's activation checkpointing of T5-family blocks, as its users apply it: its ``checkpoint`` as
transformers' checkpoint function (``_set_gradient_checkpointing(gradient_checkpointing_func=...)``), or
around each block's forward. Reentrant (it detaches the inputs): the relative bias must be recomputed
from the layer's arguments. One row with a hole in its mask, the case stock gets wrong and a recomputed
layer that differed would be silently off; the gradients against the row alone on stock."""

from __future__ import annotations

import functools

import pytest
from test_checkpointing import NO_DROPOUT, ROWS, _blocks, _loss_and_grads, _reference, _worst

from hfpatch.verification.tiny import tiny_seq2seq

checkpointing = pytest.importorskip("deepspeed.runtime.activation_checkpointing.checkpointing")


def _around_each_block(model) -> None:
    for block in _blocks(model):
        forward = block.forward
        block.forward = lambda *args, _f=forward, **kwargs: checkpointing.checkpoint(
            functools.partial(_f, **kwargs), *args
        )


@pytest.mark.parametrize("how", ["transformers' function", "around each block"])
@pytest.mark.parametrize("arch", ["t5", "umt5"])
def test_deepspeed_checkpointing_gives_the_rows_own_gradients(arch, how):
    model = tiny_seq2seq(arch, attention="eager", **NO_DROPOUT).train()
    rows = ROWS[:1]
    loss_ref, grads_ref = _reference(model, rows)
    if how == "around each block":
        _around_each_block(model)
    else:
        model.gradient_checkpointing_enable()
        model._set_gradient_checkpointing(True, gradient_checkpointing_func=checkpointing.checkpoint)
    loss, grads = _loss_and_grads(model, rows, "hole, one row")
    assert abs(loss - loss_ref) <= 1e-5 * abs(loss_ref), (loss, loss_ref)
    worst = _worst(grads, grads_ref)
    assert worst <= 1e-5, f"{arch} ({how}): gradients off by {worst:.2e} of the largest"
