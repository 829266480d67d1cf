"""Which keys a query may see, decided by position, not by cache column: sliding windows, attention
chunks, and the sequences packed into one row.

transformers decides which keys fall inside a sliding window (or an attention chunk) by cache column,
and its sliding cache layers keep a fixed number of trailing columns. When a padded prefix leaves holes
in the cache, a later token's window covers fewer real tokens than the same row run alone, and keys
inside the window by position may already be gone. A row that packs several sequences (positions that
restart: ``DataCollatorWithFlattening``, TRL's ``padding_free``) lets every sequence attend to the ones
before it, whatever the mask says. Positions alone cannot fix either, so for a call whose positions
hfpatch derives (or the caller's, where they restart in a row), on a model whose own mask code takes a
4-D mask (:class:`MaskPlan`; eager or SDPA attention, flex for a packed row on 4.53+):

1. the cache keeps every key: sliding or chunked cache layers that have dropped nothing yet are
   swapped for full ones (the window is then the mask's job; a cache the model would create itself is
   created here, as it would be, so that its layers can be swapped);
2. the masks are built here from the 2-D mask by the one rule (:func:`hfpatch.positions.keys_seen`:
   real, causal, in the query's packed sequence, within the window by position), rendered dense or as
   flex attention's ``BlockMask``, one per layer type, and handed to the
   model as the ``{layer_type: mask}`` dict its forward takes (4.53+), or as the one 4-D mask of a model
   with one layer type, in the form its mask code reads (:data:`FORMS`).

Only shapes, object types and tensor ops in the per-call path. The cost: a full-length cache for the
sliding layers of such a call (the memory of a model without a window), and a mask per layer type (a
packed row: ``length x length`` booleans for SDPA, the model's float dtype for eager: as transformers'
own mask for a packed row).
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any, NamedTuple, Optional, Union

import torch

from . import caches
from ._compat import asked, cache_utils
from ._context import patched_here
from .attention import MAPPING, ByLayout, Carrier, carrier, compiled_layout
from .backends import (
    BACKENDS,
    BLOCK_MASK,
    BY_COLUMN,
    DENSE,
    LENGTHS,
    OWN,
    SDPA,
    Backend,
    backend_of,
    by_sequence_on,
)  # fmt: skip
from .compiled import OP
from .layout import grouped
from .positions import cache_positions, keys_seen, sequence_lengths, window_mask
from .sources import (
    attends_inline,
    hands_masks_on,
    passes_4d_mask_as_given,
    reads_2d_mask_only,
    source_of,
    state_mixers,
    takes_mask_dict,
    unreadable_with_mask_dict,
)

__all__ = [
    "FORMS",
    "MaskPlan",
    "apply_masks",
    "configured_window",
    "layer_types",
    "mask_plan",
    "backend",
    "kept_on",
    "packed_not_kept",
    "positional",
    "smallest_window",
    "text_config",
    "whole_cache",
    "window_of",
]

SLIDING, CHUNKED, FULL = "sliding_attention", "chunked_attention", "full_attention"
# DeepSeek V3.2's sparse attention (so named up to 5.17): its indexer picks among the keys the mask allows,
# a full-attention layer otherwise; Qwen4-Exp's (so named on 5.16-5.17) alike
INDEXED = ("indexed_attention", "deepseek_sparse_attention", "qwen_sparse_attention")
KNOWN_TYPES = (FULL, SLIDING, CHUNKED, *INDEXED)  # the layer types whose masks hfpatch builds
# layer types of models whose layers carry a state (hfpatch.mixers): those that take the 2-D mask (a state
# layer's: it runs by sequence, the mask only zeroes the pads), those that take none (no token mixing), and
# those that hold an attention and a state layer (their attention's mask is the kind they name)
MIXED, UNMASKED = ("linear_attention", "conv"), ("moe", "mlp")
HOLDS = {"hybrid": FULL, "hybrid_sliding": SLIDING}


def backend(model: Any) -> tuple[Any, Optional[Backend]]:
    """A model's attention implementation (its text config's) and its :class:`Backend`."""
    attention = getattr(text_config(model), "_attn_implementation", None)
    return attention, backend_of(attention)


# how a class's mask code reads a 4-D mask it is given
MASK_FUNCTIONS = "mask functions"  # masking_utils (4.53+): as given; bool for SDPA, float for eager
ADDITIVE = "additive"  # ``_update_causal_mask`` 4.42-4.52: as given, 0 or the dtype's minimum
BINARY = "binary"  # ``_update_causal_mask`` 4.38-4.41: 1 where attended, 0 where not
FORMS = (MASK_FUNCTIONS, ADDITIVE, BINARY)
CREATORS = (
    "create_causal_mask", "create_sliding_window_causal_mask", "create_chunked_causal_mask",
    "create_masks_for_generate",
)  # fmt: skip


class MaskPlan(NamedTuple):
    """What a class's code says about the masks it takes, read once when it is patched."""

    form: str  # how its mask code reads a 4-D mask (FORMS)
    takes_mask_dict: bool  # its forward takes ``{layer_type: mask}`` as ``attention_mask`` (4.53+)
    sizes_by_slots: bool  # ``cache.get_mask_sizes(cache_position, layer)`` (4.53-4.57), else by query length
    windowed: bool = False  # its own mask code applies a sliding window or chunks (eager or SDPA)
    switch_ignored: bool = False  # its mask applies ``config.sliding_window`` whatever ``use_sliding_window``
    # says (Qwen2 4.49-4.51, Qwen3 4.51: a window the config switches off is applied all the same)
    decoder_cache: bool = False  # an encoder-decoder model's decoder (T5Gemma): its cache is an
    # ``EncoderDecoderCache``, whose self-attention cache holds the windowed layers
    packed: bool = True  # a row whose positions restart is kept to its sequences (not a seq2seq decoder's)
    # its forward hands ``**kwargs`` on to the attention, and the release's flash attention takes sequence
    # lengths (``cu_seq_lens_q``, 4.47+): a packed row with a mask reaches flash attention by its lengths
    flash_lengths: bool = False
    # its forward may build ALiBi from the 2-D mask it is given (Falcon with ``alibi=True``): a mask by
    # sequence would replace it, so such a model's packed rows are left to stock
    alibi: bool = False
    # its module's attention runs through its own attention functions (``ALL_ATTENTION_FUNCTIONS``, which
    # hfpatch makes module-scoped: hfpatch.attention), none inline: a packed row's layout reaches them
    by_layout: bool = False
    # its module has layers that carry a state from token to token, run by sequence (hfpatch.mixers)
    mixers: bool = False
    # its ``_update_causal_mask`` reads a 2-D mask only (a 4-D one ignored): patched to take a 4-D mask as
    # given, as 4.42-4.52's do (:func:`given_mask`)
    given: bool = False
    # its layers hand a layer type's mask to the attention functions untouched (read from its code, none
    # of its own state layers): compiled, its packed row's layout reaches them as data (hfpatch.attention)
    as_data: bool = False
    # in eager mode a packed row's layout reaches its attention as the mask (a placeholder that carries it:
    # hfpatch.attention): its mask code passes a 4-D mask on as given (masking_utils'; an
    # ``_update_causal_mask``, patched to pass the placeholder: :func:`given_mask`), and its attention runs
    # by layout (its own attention functions) or calls SDPA itself (4.39-4.47: SDPA attention only)
    laid_out: bool = False

    @property
    def float_masks(self) -> bool:
        """Before masking_utils (< 4.53) every 4-D mask a model takes is a float one."""
        return self.form != MASK_FUNCTIONS

    @property
    def block_masks(self) -> bool:
        """Its mask code is masking_utils' functions (4.53+), which take a ``BlockMask`` (flex)."""
        return self.form == MASK_FUNCTIONS


def mask_plan(owner: type, packed: bool = True) -> Optional[MaskPlan]:
    """The plan, or None where the class's mask code takes no 4-D mask hfpatch knows the form of (before
    4.38, and models with mask code of their own: GPT-2 before 4.52 ...). ``windowed``: its own mask code
    applies a window in eager or SDPA attention (from 4.42; Qwen2, Mixtral, Starcoder2, Phi-3 before
    4.53 apply one only in flash attention, over unpadded rows, so a windowed mask would make them wrong).
    ``packed``: whether a packed row is kept to its sequences (False: seq2seq decoders)."""
    update = getattr(owner, "_update_causal_mask", None)
    # the 4-D mask it builds: a static method (4.44, 4.46+) or a function of its module (4.45)
    name = "_prepare_4d_causal_attention_mask_with_cache_position"
    builder = getattr(owner, name, None) or getattr(sys.modules.get(owner.__module__), name, None)
    source, update_source, builder_source = (
        source_of(function) if function is not None else "" for function in (owner.forward, update, builder)
    )
    if source is None or update_source is None or builder_source is None:
        return None
    # 4.53+: masks per layer type (a seq2seq decoder's: ``self_attn_mask_mapping``)
    takes_dict = takes_mask_dict(source)
    if takes_dict and unreadable_with_mask_dict(source):
        return None  # the forward cannot take the masks as a dict: its masks stay transformers'
    masking_utils = takes_dict or any(
        name in source for name in ("create_sliding_window_causal_mask", "create_chunked_causal_mask")
    )
    windowed = masking_utils or "sliding_window" in update_source
    if takes_dict or any(name in source + update_source for name in CREATORS):
        form = MASK_FUNCTIONS
    elif passes_4d_mask_as_given(update_source + builder_source) or (windowed and update_source):
        form = ADDITIVE
    elif "mask_slice" in update_source:
        form = BINARY
    elif reads_2d_mask_only(update_source):
        form = ADDITIVE
    else:
        return None
    getter = getattr(cache_utils.Cache, "get_mask_sizes", None)
    by_slots = getter is not None and "cache_position" in inspect.signature(getter).parameters
    ignored = not masking_utils and "use_sliding_window" not in update_source + builder_source
    decoder = "EncoderDecoderCache(" in source
    lengths = _flash_takes_lengths() and any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(owner.forward).parameters.values()
    )
    alibi = "alibi" in source
    module = sys.modules.get(owner.__module__)
    by_layout = hasattr(module, MAPPING) and not attends_inline(module)
    mixers = module is not None and bool(state_mixers(module))
    as_data = by_layout and not mixers and hands_masks_on(module, owner)
    given = form == ADDITIVE and reads_2d_mask_only(update_source)
    passes_on = form == MASK_FUNCTIONS or update is not None
    inline = module is not None and source_of(module) is not None and attends_inline(module)
    laid_out = passes_on and (by_layout or inline)
    return MaskPlan(
        form,
        takes_dict,
        by_slots,
        windowed,
        ignored,
        decoder,
        packed,
        lengths,
        alibi,
        by_layout,
        mixers,
        given,
        as_data,
        laid_out,
    )


def given_mask(original: Callable, pin: Any, any_4d: bool) -> Callable:
    """Installed as the ``_update_causal_mask`` of a class (before 4.53): a packed row's layout
    (:class:`~hfpatch.attention.Carrier`) is handed on as given, and where the class's own reads a 2-D
    mask only (:attr:`MaskPlan.given`: stock ignores a 4-D one silently) any 4-D mask hfpatch hands it;
    anything else goes to the class's own. A plain function (``__wrapped__``: its code is read through
    it, hfpatch.sources): dynamo traces it as the method it replaces (a descriptor of hfpatch's own
    recursed in a compiled training call)."""

    @functools.wraps(original)
    def _update_causal_mask(self: Any, attention_mask: Any, *args: Any, **kwargs: Any) -> Any:
        if attention_mask.__class__ is Carrier:
            return attention_mask
        four = any_4d and isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4
        if four and patched_here(pin):
            return attention_mask
        return original(self, attention_mask, *args, **kwargs)

    return _update_causal_mask


def _flash_takes_lengths() -> bool:
    """Whether the release's flash attention takes a packed row's sequence lengths (``cu_seq_lens_q``)."""
    utils = sys.modules.get("transformers.modeling_flash_attention_utils")
    forward = getattr(utils, "_flash_attention_forward", None)
    try:
        return forward is not None and "cu_seq_lens_q" in inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return False


def _layout_as_data(plan: MaskPlan, attention: Any) -> bool:
    """Whether a compiled packed row's layout reaches the class's SDPA as data (the custom op runs it by
    sequence: :mod:`hfpatch.compiled`)."""
    used = by_sequence_on(attention)
    return used is not None and used.as_data and plan.as_data and plan.form == MASK_FUNCTIONS and OP


def by_sequence_compiled(model: Any, plan: Optional[MaskPlan]) -> bool:
    """Whether a compiled packed row of ``model`` reaches its attention by sequence, not by a dense mask:
    SDPA by its layout, flex by a ``BlockMask``, flash by the lengths."""
    attention, used = backend(model)
    if used is None or plan is None or not used.keeps(plan):
        return False
    return _layout_as_data(plan, attention) if used.takes == DENSE else True


def apply_masks(
    model: Any, plan: MaskPlan, cache_kw: Optional[str], kwargs: dict, cache: Any,
    mask: torch.Tensor, num_new: int, start: Union[int, torch.Tensor],
    packed: Any = None,
) -> Optional[str]:  # fmt: skip
    """Replace ``kwargs["attention_mask"]`` (the 2-D ``mask``, whose new tokens start at column ``start``
    (an int) or sit at the 1-D slots ``start``) with masks by position, where the model's config has
    windowed layers this handles (keeping the cache whole), or where ``packed`` (a packed row's
    (:class:`~hfpatch.layout.Layout`, over the mask's columns) says several sequences share a row.
    Returns None, or why the masks stay transformers' for want of a way to build them here (the
    attention, a layer type this does not know, a cache whose sliding layers it cannot keep whole, a pad
    inside a packed sequence for flash attention)."""
    config = text_config(model)
    attention, used = backend(model)
    flex = used is not None and used.takes == BLOCK_MASK and packed is not None and used.keeps(plan)
    flash = used is not None and used.takes == LENGTHS
    if used is None or (used.takes == BLOCK_MASK and not flex):
        return f"with {attention} attention (hfpatch's masks reach {_labels(plan)} attention)"
    named = layer_types(config, plan) if plan.windowed else [FULL]
    types = attention_kinds(named, plan)
    windows = {kind: window_of(config, kind) for kind in dict.fromkeys(types)}
    if plan.decoder_cache:  # T5Gemma 2 merges each kind with the cross mask, whichever its layers use
        windows.setdefault(FULL, None)
    sizes = [size for size in windows.values() if size is not None]
    if not set(windows) <= set(KNOWN_TYPES) or (len(windows) > 1 and not plan.takes_mask_dict and not flash):
        return LAYER_TYPES  # a layer type this does not know (linear, hybrid ...): left to stock
    if packed is None:
        if not sizes:
            return None  # no window: nothing to decide by position
        cache = whole_cache(model, plan, config, cache_kw, kwargs, cache)
        if cache is False:
            return "its cache's sliding layers cannot be kept whole here"
        if flash or mask.shape[1] <= min(window or chunk for window, chunk in sizes):
            # every key inside every window, by column and by position alike: stock's are right; flash
            # attention applies its window over the unpadded keys (by position), all of them kept now
            return None
    elif flash:
        if not plan.flash_lengths:
            return FLASH_NO_LENGTHS
        return _by_lengths(kwargs, packed)
    positions, segment_ids = (packed.positions, packed.segment_ids) if packed is not None else (None, None)
    eager_mode = not torch.compiler.is_compiling()
    # (attention weights asked for, by keyword or the config: the dense mask, whose weights are stock's;
    # an attention function is not always told: GPT-2's before 5.0)
    weights = asked(kwargs, config, "output_attentions")
    by_layout = plan.laid_out and used.takes == DENSE and eager_mode and not weights
    if by_layout and not plan.by_layout:  # (its attention calls SDPA itself: SDPA only)
        by_layout = attention == SDPA
    if packed is not None and by_layout:  # the layout, once: each layer type's mask (hfpatch.attention)
        laid = grouped(packed)
        made = {
            kind: carrier(ByLayout(laid, *(size or (None, None))), model.dtype)
            for kind, size in windows.items()
        }
        kwargs["attention_mask"] = _handed(made, named, types, plan, mask[:, -num_new:])
        return None
    if packed is not None and _layout_as_data(plan, attention):
        # compiled (traced once: no group by group here): each layer type's layout as one small tensor,
        # which the module's SDPA runs by sequence in a custom op (hfpatch.attention.sdpa_by_sequence)
        real = mask != 0
        made = {
            kind: compiled_layout(real, segment_ids, positions, *(size or (None, None)))
            for kind, size in windows.items()
        }
        kwargs["attention_mask"] = _handed(made, named, types, plan, mask[:, -num_new:])
        return None
    slots = start if isinstance(start, torch.Tensor) else cache_positions(num_new, start, mask.device)
    per_layer = [HOLDS.get(kind, kind) for kind in named] if plan.mixers else named  # (a layer's cache index)
    first = {
        kind: per_layer.index(kind) if kind in per_layer else 0 for kind in windows
    }  # (a kind no layer uses)
    masks = {}
    for kind, size in windows.items():
        if flex:  # a packed row (nothing cached): its BlockMask, from the rule's parts
            masks[kind] = _block_mask(mask, positions, segment_ids, *(size or (None, None)))
            continue
        kv_length, kv_offset = _mask_sizes(plan, cache, first[kind], slots, mask.shape[1] - num_new)
        padded = mask
        if kv_length + kv_offset > mask.shape[1]:  # a static cache's columns past the mask: pads
            padded = torch.nn.functional.pad(mask, (0, kv_length + kv_offset - mask.shape[1]))
        keys = torch.arange(kv_length, device=mask.device) + kv_offset
        allowed = window_mask(
            padded, slots, keys, *(size or (None, None)), positions=positions, segment_ids=segment_ids
        )
        masks[kind] = _as_model_takes(allowed, plan, attention, model.dtype)
    kwargs["attention_mask"] = _handed(masks, named, types, plan, mask[:, -num_new:])
    return None


def attention_kinds(types: list[str], plan: Optional[MaskPlan]) -> list[str]:
    """Each layer's attention kind, of a model whose layers may carry a state (:mod:`hfpatch.mixers`):
    a layer that holds an attention and a state layer gives its attention's kind, one that attends to
    nothing (a state layer alone, an MLP) none. Any other model's layer types, as they are."""
    if plan is None or not plan.mixers:
        return types
    kinds = [HOLDS.get(kind, kind) for kind in types if kind not in MIXED + UNMASKED]
    return kinds or [FULL]


def _handed(masks: dict, named: list[str], types: list[str], plan: MaskPlan, flat: torch.Tensor) -> Any:
    """What the model's forward takes: the masks by layer type (a model with state layers: also each of
    its layer types by name, the state layers' the 2-D mask of the new tokens, as transformers' own
    ``create_recurrent_attention_mask`` gives them), or the one mask of a forward that takes no dict."""
    if not plan.takes_mask_dict:
        return masks[types[0]]
    if plan.mixers:
        masks.setdefault(FULL, masks[types[0]])
        for kind in (*named, *MIXED):
            if kind not in masks:
                masks[kind] = (
                    flat if kind in MIXED else None if kind in UNMASKED else masks[HOLDS.get(kind, FULL)]
                )
    return masks


LAYER_TYPES = "its layer types take no mask by position"
FLASH_NO_LENGTHS = "flash attention with a mask takes no sequence lengths here"


def _by_lengths(kwargs: dict, packed: Any) -> Optional[str]:
    """A packed row for flash attention: no mask (it would unpad each row as one sequence), and the
    sequences by their lengths over the flattened rows instead, ``cu_seq_lens_q/k`` and ``max_length_q/k``
    (transformers' own packed path reads the positions, which some models do not hand their attention);
    each run of pads is a sequence of its own, never attended by a real token. Why not (left to stock)
    where a pad sits inside a sequence: the lengths cannot skip it."""
    real, segment_ids = packed.host if packed.host is not None else (packed.mask, packed.segment_ids)
    cu_seq_lens, pieces = sequence_lengths(segment_ids, real)  # (from the host's read, where there is one)
    if pieces:
        return "flash attention with a pad inside a packed sequence (its lengths cannot skip a pad)"
    longest = int((cu_seq_lens[1:] - cu_seq_lens[:-1]).max())
    cu_seq_lens = cu_seq_lens.to(packed.mask.device, non_blocking=True)
    kwargs["attention_mask"] = None
    kwargs.update(
        cu_seq_lens_q=cu_seq_lens, cu_seq_lens_k=cu_seq_lens, max_length_q=longest, max_length_k=longest
    )
    return None


def whole_cache(
    model: Any, plan: MaskPlan, config: Any, cache_kw: Optional[str], kwargs: dict, cache: Any
) -> Any:
    """The cache with its sliding layers kept whole (one the model would create itself is created here,
    as it would be, so that its layers can be swapped); False for a cache whose sliding layers this
    cannot keep whole (4.45-4.53's fixed-size ones)."""
    wants_cache = kwargs.get("use_cache")  # None (a seq2seq model passes its own on): the config says
    if wants_cache is None:
        wants_cache = getattr(config, "use_cache", True)
    if cache is None and cache_kw is not None and wants_cache:
        cache = _new_cache(model.config, plan.decoder_cache)
        if cache is not None:
            kwargs[cache_kw] = cache
    cache = caches.own(cache)  # a decoder's EncoderDecoderCache: its self-attention one holds the windows
    if cache is not None and not caches.keep_whole_window(cache):
        return False
    return cache


NO_4D_MASK = "its mask code takes no 4-D mask on this transformers release"


def packed_not_kept(model: Any, plan: Optional[MaskPlan], masked: bool) -> Optional[str]:
    """Why a packed row of ``model`` (the patched module's plan) is not kept to its sequences here, or
    None where it is: its mask code takes a 4-D mask, for layer types this knows, in an attention that
    reads it (eager, SDPA; flex where the mask functions take its BlockMask; flash by the sequences'
    lengths, mask or not: a model may hand flash attention no positions). "" where transformers keeps it
    itself (flash attention without a mask, on releases whose flash takes no lengths: by the positions).
    ``masked``: the call has a 2-D mask."""
    if plan is None or not plan.packed:
        return NO_4D_MASK
    config = text_config(model)
    attention, used = backend(model)
    if used is not None and used.own_packing and not used.keeps(plan):
        return FLASH_NO_LENGTHS if masked else ""  # transformers' own, by the positions, given no mask
    if plan.alibi and getattr(config, "alibi", False) is True:  # Falcon's: from the 2-D mask it is given
        # (by column over the row, in bfloat16: a sequence from column 200 of a packed row gets biases up to
        # 0.5 off its own, 16 from column 16,000, measured; exact only from each sequence's positions)
        return "its ALiBi (alibi=True) counts the row's columns in bfloat16: off for a row's later sequences"
    kinds = set(attention_kinds(layer_types(config, plan), plan)) if plan.windowed else {FULL}
    if not kinds <= set(KNOWN_TYPES):
        return LAYER_TYPES
    if used is None or not used.keeps(plan):
        return f"with {attention} attention (a mask by sequence reaches {_labels(plan)} attention)"
    if used.takes != LENGTHS and len(kinds) > 1 and not plan.takes_mask_dict:
        return LAYER_TYPES
    return None


def kept_on(plan: MaskPlan) -> list[str]:
    """The labels of the backends a class of this plan keeps a packed row on (``status()``'s answer)."""
    return [used.label for used in BACKENDS.values() if used.keeps(plan)]


def _labels(plan: MaskPlan) -> str:
    labels = kept_on(plan)
    return ", ".join(labels[:-1]) + f" or {labels[-1]}" if len(labels) > 1 else "".join(labels)


def positional(model: Any, cls: str) -> bool:
    """Whether hfpatch decides ``model``'s windows by position: its module of class ``cls`` (the patched
    one) builds windowed masks hfpatch can replace, for layer types it knows, in eager or SDPA attention."""
    owner = _owner(model, cls)
    config = text_config(model)
    plan = mask_plan(owner) if owner is not None else None
    if plan is None or not plan.windowed:
        return False
    kinds = set(attention_kinds(layer_types(config, plan), plan))
    _, used = backend(model)
    if used is None or used.windows == BY_COLUMN or not kinds <= set(KNOWN_TYPES):
        return False
    return used.windows == OWN or len(kinds) == 1 or plan.takes_mask_dict  # (its own: over every key kept)


def smallest_window(model: Any, cls: Optional[str] = None) -> Optional[int]:
    """The smallest sliding window or attention chunk of a model's layers, or None (``cls``: the patched
    class, whose mask code may apply a window its config switches off)."""
    config = text_config(model)
    owner = _owner(model, cls) if cls else None
    types = layer_types(config, mask_plan(owner) if owner is not None else None)
    sizes = [size for kind in set(types) for size in window_of(config, kind) or () if size]
    return min(sizes) if sizes else None


def configured_window(model: Any) -> Optional[int]:
    """The smaller of the sliding window and attention chunk a model's config sets, whichever layers
    (if any) use them: what a release's mask code may apply, where hfpatch does not read it."""
    config = text_config(model)
    sizes = [getattr(config, name, None) for name in ("sliding_window", "attention_chunk_size")]
    sizes = [size for size in sizes if isinstance(size, int) and size > 0]
    return min(sizes) if sizes else None


def _owner(model: Any, cls: str) -> Optional[type]:
    """The class of ``model``'s module named ``cls`` (the patched one), or None."""
    return next((type(m) for m in model.modules() if type(m).__name__ == cls), None)


def text_config(model: Any) -> Any:
    """The config of the decoder's layers: a multimodal model's text config, an encoder-decoder model's
    decoder config (4.53-4.56's ``get_text_config`` returns T5Gemma's whole config: its ``decoder``)."""
    get = getattr(model.config, "get_text_config", None)
    config = get(decoder=True) if get is not None else model.config
    decoder = getattr(model.config, "decoder", None)
    if not hasattr(config, "num_hidden_layers") and hasattr(decoder, "num_hidden_layers"):
        return decoder
    return config


def layer_types(config: Any, plan: Optional[MaskPlan] = None) -> list[str]:
    """The attention kind of each layer (``config.layer_types``, or one kind for all from the config's
    window or chunk). A config whose layer count cannot be read (4.56's Moonshine maps it to a field it
    lacks) gives one entry per kind."""
    types = getattr(config, "layer_types", None)
    count = getattr(config, "num_hidden_layers", None)
    if types is None:
        windowed = getattr(config, "use_sliding_window", True) or (plan is not None and plan.switch_ignored)
        if getattr(config, "sliding_window", None) is not None and windowed:
            return [SLIDING] * (count or 1)
        if getattr(config, "attention_chunk_size", None) is not None:
            return [CHUNKED] * (count or 1)
        return [FULL] * (count or 1)
    return list(types[:count] if count else types)


def window_of(config: Any, kind: str) -> Optional[tuple[Optional[int], Optional[int]]]:
    """(sliding window, chunk) of a layer type, or None for a full-attention one."""
    if kind == SLIDING and getattr(config, "sliding_window", None):
        return config.sliding_window, None
    if kind == CHUNKED and getattr(config, "attention_chunk_size", None):
        return None, config.attention_chunk_size
    return None


def _mask_sizes(plan: MaskPlan, cache: Any, layer: int, slots: torch.Tensor, past: int) -> tuple[int, int]:
    """The (length, offset) of the keys a layer attends to, as transformers computes them."""
    num_new = slots.shape[0]
    layers = getattr(cache, "layers", None)
    if cache is None or (layers is not None and layer >= len(layers)):  # no cache, or layers made lazily
        return past + num_new, 0
    if not hasattr(cache, "get_mask_sizes"):  # 4.42-4.52: a growing cache holds every column
        size = caches.capacity(cache)
        return (size, 0) if size is not None else (past + num_new, 0)
    if plan.sizes_by_slots:
        return cache.get_mask_sizes(slots, layer)
    return cache.get_mask_sizes(num_new, layer)


def _as_model_takes(allowed: torch.Tensor, plan: MaskPlan, attention: str, dtype: torch.dtype) -> Any:
    """What the model's mask code reads (:data:`FORMS`): eager attention adds its mask (the float form);
    SDPA (4.53+) takes the boolean one; 4.38-4.41 take 1 where attended."""
    if plan.form == BINARY:
        return allowed.to(dtype)
    used = by_sequence_on(attention)
    if plan.float_masks or (used is not None and used.additive):
        zero = torch.zeros((), dtype=dtype, device=allowed.device)
        return torch.where(allowed, zero, torch.finfo(dtype).min)
    return allowed


def _block_mask(
    mask: torch.Tensor, positions: torch.Tensor, segment_ids: torch.Tensor,
    window: Optional[int], chunk: Optional[int],
) -> Any:  # fmt: skip
    """Flex attention's ``BlockMask`` of a packed row with nothing cached, made from the row's layout:
    which blocks of 128 queries meet which blocks of keys (a query block and an earlier key block meet
    where they share a sequence; they are full where both lie in one sequence, all real, with no window
    or chunk), and :func:`keys_seen`'s rule inside the blocks that meet. Nothing ``length x length`` is
    made (``(length / 128) ** 2`` block entries); tensor ops only (compiled code too)."""
    from torch.nn.attention.flex_attention import BlockMask

    seen = keys_seen(mask, window, chunk, positions=positions, segment_ids=segment_ids)
    batch, length = mask.shape
    size = 128  # flex attention's default block
    blocks = -(-length // size)
    pad = blocks * size - length
    padded = torch.nn.functional.pad(segment_ids.expand(batch, length), (0, pad), mode="replicate")
    real = torch.nn.functional.pad((mask != 0).long(), (0, pad), value=0).view(batch, blocks, size)
    first, last = padded[:, ::size], padded[:, size - 1 :: size]  # [batch, blocks]: their sequences
    query = torch.arange(blocks, device=mask.device)[:, None]
    meet = (query >= query.T) & (last[:, None, :] >= first[:, :, None])  # [batch, query block, key block]
    whole = (first == last) & (real.sum(-1) == size)  # one sequence, all real
    full = (
        meet
        & (query > query.T)
        & whole[:, None, :]
        & whole[:, :, None]
        & (first[:, None, :] == first[:, :, None])
    )
    if window is not None or chunk is not None:
        full = torch.zeros_like(full)
    partial = meet & ~full

    def indices(chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        order = torch.argsort((~chosen).to(torch.int8), dim=-1, stable=True)
        return chosen.sum(-1).to(torch.int32)[:, None], order.to(torch.int32)[:, None]

    return BlockMask.from_kv_blocks(
        *indices(partial), *indices(full), BLOCK_SIZE=size, mask_mod=seen, seq_lengths=(length, length)
    )


def _new_cache(config: Any, decoder: bool = False) -> Any:
    """The cache the model would create itself (``DynamicCache(config=...)``, 4.56+: the releases whose
    growing cache has sliding layers; a decoder's inside an ``EncoderDecoderCache``), or None where the
    model's own keeps every column anyway."""
    if not _CACHE_TAKES_CONFIG:
        return None
    cache = cache_utils.DynamicCache(config=config)
    return cache_utils.EncoderDecoderCache(cache, cache_utils.DynamicCache()) if decoder else cache


_CACHE_TAKES_CONFIG = (
    cache_utils is not None and "config" in inspect.signature(cache_utils.DynamicCache.__init__).parameters
)
