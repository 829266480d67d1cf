"""What an adapter replaces, built as :class:`~hfpatch.patches.Patch` rows when its class is patched
(its module has been imported, so torch and transformers have too). One function reads the plan of
each target and returns every row; the engine's ledger installs them.

The rows of an adapter, in order:

1. its class's ``forward`` (:func:`hfpatch.forward.make_forward`, from the signature's
   :class:`~hfpatch.plans.Plan`), and those of its ``also`` classes (a seq2seq model's encoder);
2. its receiver's method, where its forward takes no positions (:mod:`hfpatch.decoders`);
3. the rotary classes of its module, whose length-dependent rope is scaled per row (:mod:`hfpatch.rope`),
   shared by every adapter of the module;
4. the SDPA switch on its class, on the releases ``Adapter.eager_mask`` names;
5. the static cache's sliding layer ``__init__`` (it records the length it was asked for), shared by
   every adapter;
6. where its packed rows are kept, its module's ``ALL_ATTENTION_FUNCTIONS`` and
   ``eager_attention_forward``, which run a packed row one group of sequences at a time where its layout
   reaches them (:mod:`hfpatch.attention`: module-scoped, shared by the module's adapters), and the
   forward of the task heads of its module that would drop a packed row's lengths or positions (4.57's
   GPT-2 heads, 5.x's BLOOM heads);
7. where its module has layers that carry a state (:mod:`hfpatch.mixers`), each such class's ``forward``,
   which runs a call's sequences alone where its context says;
8. where the hand-off runs inside a layer (or a state layer reads the call's sequences), the checkpoint
   function of the module's checkpointing classes, which carries the call's context into a layer's
   recomputation (:mod:`hfpatch._context`);
9. where a causal LM head's ``prepare_inputs_for_generation`` drops ``generate()``'s mask, one that
   hands it on (:func:`hfpatch.forward.handing_generated_masks`).
"""

from __future__ import annotations

from typing import Any

from . import caches
from ._context import CarryContext, Pin, SdpaSwitch, Users
from .attention import module_rows
from .declarations import Adapter, kept
from .decoders import HANDS_TO, receiver
from .deltas import delta_rows
from .forward import (
    handing_generated_masks,
    make_forward,
    recording_generated_masks,
    takes_keyword,
)
from .mixers import mixer_rows
from .packed import handing_on, task_heads
from .patches import ABSENT, Patch
from .plans import read_plan
from .rope import per_row_forward, rotary_classes
from .unpad import causal_lm_head, gate
from .verdict import padded_here, support
from .windows import MASK_FUNCTIONS, given_mask

__all__ = ["CHECKPOINT_FUNCTION", "build"]

CHECKPOINT_FUNCTION = (
    "_gradient_checkpointing_func"  # set on each instance by gradient_checkpointing_enable()
)


def build(adapter: Adapter, module: Any, pin: Pin) -> tuple[Patch, ...]:
    """Every row ``adapter`` installs in ``module``. ``TypeError`` saying what is missing or different
    when the release's classes are not the ones the adapter expects (then nothing is installed)."""
    owner = getattr(module, adapter.cls, None)
    original = getattr(owner, "__dict__", {}).get("forward")
    if owner is None or original is None:
        raise TypeError(f"{adapter.target} not found in this transformers release")
    if getattr(original, "__hfpatch_adapter__", None) is not None:
        raise TypeError(f"{adapter.target} is already an hfpatch patch (two hfpatch copies imported?)")
    heads = task_heads(module, owner)
    plan = read_plan(adapter, original, owner)
    if not takes_keyword(original, "position_ids") and not any(h.takes_positions or h.drops for h in heads):
        plan = plan._replace(no_positions=True)
    said = support(adapter, plan)
    keeps = adapter.packed is None and kept(said)  # its packed rows, by its module's attention
    # a model without attention whose heads drop the mask (RWKV's): it reaches its forward the same way
    masks_dropped = (
        not adapter.family.attends and plan.mixers and any(h.drops_mask is not None for h in heads)
    )
    if masks_dropped or (keeps and any(head.drops and not head.takes_positions for head in heads)):
        plan = plan._replace(handed=True)  # (positions its heads drop reach its forward: CALL.handed)
    rows = [Patch(owner, "forward", original, make_forward(adapter, original, plan, pin))]
    for name in adapter.also:
        cls = getattr(module, name, None)
        before = getattr(cls, "__dict__", {}).get("forward")
        if before is None:
            raise TypeError(f"{module.__name__}:{name}.forward not found in this transformers release")
        also = adapter._replace(cls=name)
        rows.append(
            Patch(cls, "forward", before, make_forward(also, before, read_plan(also, before, cls), pin))
        )
    hands_to = adapter.family.hands_to
    if adapter.receiver is not None:
        cls = getattr(module, adapter.receiver, None)
        found = receiver(cls, hands_to, pin) if isinstance(cls, type) else None
        if found is None:
            raise TypeError(f"{module.__name__}:{adapter.receiver} not found in this transformers release")
        rows.extend(found)
    users = Users()
    for rotary in rotary_classes(module):
        rows.append(Patch(rotary.cls, "forward", rotary.forward, per_row_forward(rotary, users), users))
    if plan.eager_mask_attr is not None:
        name = plan.eager_mask_attr
        rows.append(Patch(owner, name, owner.__dict__.get(name, ABSENT), SdpaSwitch(name)))
    masks = plan.masks
    if masks is not None and masks.form != MASK_FUNCTIONS and (masks.laid_out or masks.given):
        name = "_update_causal_mask"  # (a packed row's layout passed on; a 4-D mask it would ignore taken)
        given = given_mask(getattr(owner, name), pin, masks.given)
        rows.append(Patch(owner, name, owner.__dict__.get(name, ABSENT), given))
    shared = (caches.recording_requested_lengths(), recording_generated_masks())
    rows.extend(row for row in shared if row is not None)  # (every adapter's: the ledger counts them)
    if keeps:  # its module's attention functions, by sequence where a packed row's layout reaches them
        rows.extend(module_rows(module))
    mixes = plan.mixers
    if mixes:  # its layers that carry a state, by sequence where a call's sequences say (hfpatch.mixers)
        rows.extend(mixer_rows(module))
    keys = {row.key for row in rows}  # a wrapper that keeps rope deltas: its cached calls by real tokens
    rows.extend(row for row in delta_rows(module, pin) if row.key not in keys)
    unpads = padded_here(adapter, plan, said) is None
    for head in heads:  # (where they are not kept, a head that drops a packed row's inputs drops them)
        mask_at = head.drops_mask if masks_dropped else None
        hands_on = (head.drops and keeps) or mask_at is not None
        replacement = (
            handing_on(head.forward, pin, head.takes_positions, mask_at) if hands_on else head.forward
        )
        if unpads and head.targets:  # apply(unpad=True): a causal LM's head unpadded, any head's targets read
            replacement = gate(
                replacement, pin, plan.masks, plan.cache_kw, causal_lm_head(head.cls), head.pools, plan.mixers
            )
        if replacement is not head.forward:  # (on the head's class itself, where it inherits its forward)
            rows.append(Patch(head.cls, "forward", head.own, replacement))
    rows.extend(handing_generated_masks(heads, pin))  # (a generate() that drops the mask: hands it on)
    if mixes or (hands_to is not None and HANDS_TO[hands_to].inside_layers):
        for cls in _checkpointing_classes(module, owner):
            before = cls.__dict__.get(CHECKPOINT_FUNCTION, ABSENT)
            rows.append(Patch(cls, CHECKPOINT_FUNCTION, before, CarryContext(CHECKPOINT_FUNCTION)))
    return tuple(rows)


def _checkpointing_classes(module: Any, owner: type) -> list[type]:
    """The classes of ``module`` whose instances call ``self._gradient_checkpointing_func``: the patched
    stack (which checkpoints its layers up to 5.x) and the layers that checkpoint themselves (5.x:
    subclasses of transformers' ``GradientCheckpointingLayer``)."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # before the layers checkpointed themselves
        GradientCheckpointingLayer = None  # noqa: N806
    found = [owner]
    for value in vars(module).values():
        if (
            isinstance(value, type)
            and value.__module__ == module.__name__
            and GradientCheckpointingLayer is not None
            and issubclass(value, GradientCheckpointingLayer)
        ):
            found.append(value)
    return found
