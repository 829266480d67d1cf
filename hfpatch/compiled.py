"""A compiled packed row's attention by sequence: two custom ops (``hfpatch::sdpa_by_sequence`` and its
backward) that the module's SDPA by layout (:mod:`hfpatch.attention`) hands a layer's query, key and value
with the layout as one integer tensor (:func:`hfpatch.attention.compiled_layout`). Dynamo sees an op with
the query's shape out, so a graph neither breaks nor depends on the sequences' lengths; the op runs the
groups as eager mode does (:func:`hfpatch.attention.by_sequence`), reading the layout to the host once a
call and layer type (at its first layer: every layer of a type is handed the same tensor). Registered
once a process, at import (:data:`OP`: False before torch 2.4, or where another copy of hfpatch
registered them first)."""

from __future__ import annotations

import threading
import weakref
from typing import Any, Optional

import torch
from torch import Tensor

from .attention import ByLayout, by_sequence, sdpa_call
from .backends import BACKENDS, SDPA
from .layout import Layout, grouped

__all__ = ["OP", "sdpa_by_sequence", "sdpa_by_sequence_backward"]

# the layouts last read in this thread, newest first, one a layer type: (its tensor, weakly; its version;
# what it says)
_READ = threading.local()
KEPT = 4  # layer types a call's layouts are kept for (full, sliding, chunked, and one more)


def _read_layout(layout: Tensor) -> ByLayout:
    """What a compiled layout says, read to the host once a call and layer type: every layer of a type is
    handed the same tensor, so the read and the indices are made at its first layer and reused by the
    others, however the types alternate (Gemma 3's), and by the backward."""
    kept = getattr(_READ, "kept", None)
    if kept is None:
        kept = _READ.kept = []
    for made, version, found in kept:
        if made() is layout and version == layout._version:
            return found
    host = layout[:, :, 0].cpu()
    real, segment_ids, positions = host[:, 0] != 0, host[:, 1], host[:, 2]
    window, chunk = (int(host[0, i, 0]) for i in (3, 4))
    device = layout.device
    laid = Layout(real.to(device), positions.to(device), segment_ids.to(device), (real, segment_ids))
    found = ByLayout(grouped(laid), None if window < 0 else window, None if chunk < 0 else chunk)
    kept.insert(0, (weakref.ref(layout), layout._version, found))
    del kept[KEPT:]
    return found


def _run(query: Tensor, key: Tensor, value: Tensor, layout: Tensor, scale: Optional[float]) -> Tensor:
    return by_sequence(
        sdpa_call, BACKENDS[SDPA], None, query, key, value, _read_layout(layout), {"scaling": scale}
    )[0]


def sdpa_by_sequence(
    query: Tensor, key: Tensor, value: Tensor, layout: Tensor, scale: Optional[float]
) -> Tensor:
    """SDPA on each group of a packed row's sequences alone (:func:`by_sequence`), its layout read from
    ``layout`` (:func:`compiled_layout`): a custom op, outside the traced graph, so that one graph serves
    every stream of lengths; ``[batch, length, heads, dim]`` out."""
    return _run(query, key, value, layout, scale)


def _sdpa_by_sequence_fake(
    query: Tensor, key: Tensor, value: Tensor, layout: Tensor, scale: Optional[float]
) -> Tensor:
    batch, heads, length, _ = query.shape
    return query.new_empty(batch, length, heads, value.shape[-1])


def sdpa_by_sequence_backward(
    grad: Tensor, query: Tensor, key: Tensor, value: Tensor, layout: Tensor, scale: Optional[float]
) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of :func:`sdpa_by_sequence`: its groups run again under autograd (which a custom op's
    body runs without: put back for it, autocast left off), so each group's SDPA takes its own backward
    (not a decomposition that would hold every group's attention weights)."""
    include = torch._C._dispatch_tls_local_include_set()
    exclude = torch._C._dispatch_tls_local_exclude_set().remove(torch._C.DispatchKey.AutogradFunctionality)
    inputs = [t.detach().requires_grad_() for t in (query, key, value)]
    with torch._C._ForceDispatchKeyGuard(include, exclude), torch.enable_grad():
        out = _run(*inputs, layout, scale)
        dq, dk, dv = torch.autograd.grad(out, inputs, grad)
    return dq, dk, dv


def _backward_fake(
    grad: Tensor, query: Tensor, key: Tensor, value: Tensor, layout: Tensor, scale: Optional[float]
) -> tuple[Tensor, Tensor, Tensor]:
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def _setup(ctx: Any, inputs: tuple, output: Tensor) -> None:
    query, key, value, layout, scale = inputs
    ctx.save_for_backward(query, key, value, layout)
    ctx.scale = scale


def _backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
    query, key, value, layout = ctx.saved_tensors
    dq, dk, dv = torch.ops.hfpatch.sdpa_by_sequence_backward(grad, query, key, value, layout, ctx.scale)
    return dq, dk, dv, None, None


def _register() -> bool:
    """Register the two custom ops (torch 2.4+; where another copy of hfpatch registered them first, its
    ops stay and this copy's compiled packed rows stay dense): whether they are this copy's."""
    if not (hasattr(torch.library, "custom_op") and hasattr(torch._C, "_ForceDispatchKeyGuard")):
        return False
    try:
        forward = torch.library.custom_op("hfpatch::sdpa_by_sequence", mutates_args=())(sdpa_by_sequence)
        backward = torch.library.custom_op("hfpatch::sdpa_by_sequence_backward", mutates_args=())(
            sdpa_by_sequence_backward
        )
    except RuntimeError:
        return False
    forward.register_fake(_sdpa_by_sequence_fake)
    backward.register_fake(_backward_fake)
    forward.register_autograd(_backward, setup_context=_setup)
    return True


OP = _register()  # the compiled route: else a compiled packed row keeps the dense masks
