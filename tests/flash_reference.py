"""transformers' flash-attention integration on the CPU: FlashAttention-2's two kernels written in torch
(``flash_attn_func`` and ``flash_attn_varlen_func``: causal aligned bottom-right, grouped-query heads,
a sliding window ``(left, right)``, softcap), put where transformers keeps the kernels it imported, so
that a model with ``_attn_implementation = "flash_attention_2"`` runs transformers' own unpadding,
varlen and packed-sequence code with them. A test fixture: the runtime never imports it."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

import torch

FLASH = "flash_attention_2"
# where transformers keeps what it imported (4.44+: the module's globals, read before importing again)
KERNELS = ("_flash_fn", "_flash_varlen_fn", "_pad_fn", "_unpad_fn")


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Any, causal: bool, window: Any,
            softcap: float) -> torch.Tensor:  # fmt: skip
    """One sequence: ``q`` ``[queries, heads, dim]``, ``k``/``v`` ``[keys, kv heads, dim]``; queries aligned
    with the last keys (FlashAttention >= 2.1); a query that sees no key gets zeros, as the kernel's."""
    queries, heads, dim = q.shape
    keys = k.shape[0]
    repeat = heads // k.shape[1]
    k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * (dim**-0.5 if scale is None else scale)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    at = torch.arange(queries)[:, None] + (keys - queries)
    key = torch.arange(keys)[None, :]
    seen = torch.ones(queries, keys, dtype=torch.bool)
    if causal:
        seen &= key <= at
    left, right = window if window is not None else (-1, -1)
    if left >= 0:
        seen &= key >= at - left
    if right >= 0:
        seen &= key <= at + right
    weights = scores.masked_fill(~seen, float("-inf")).softmax(-1).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", weights, v.float()).to(q.dtype)


def flash_attn_func(
    q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
    alibi_slopes=None, deterministic=False, return_attn_probs=False,
):  # fmt: skip
    """``[batch, length, heads, dim]``, every row alike."""
    return torch.stack(
        [_attend(q[b], k[b], v[b], softmax_scale, causal, window_size, softcap) for b in range(q.shape[0])]
    )


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                           alibi_slopes=None, deterministic=False, return_attn_probs=False,
                           block_table=None):  # fmt: skip
    """``[tokens, heads, dim]``, the sequences one after the other as ``cu_seqlens_*`` say."""
    out = torch.zeros_like(q)
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(starts_q) - 1):
        sq, eq, sk, ek = starts_q[i], starts_q[i + 1], starts_k[i], starts_k[i + 1]
        if eq > sq:
            out[sq:eq] = _attend(q[sq:eq], k[sk:ek], v[sk:ek], softmax_scale, causal, window_size, softcap)
    return out


@contextlib.contextmanager
def reference_flash() -> Iterator[bool]:
    """transformers' flash-attention integration with the kernels above, for the block; False where the
    release has no place for them (before 4.44)."""
    try:
        utils = importlib.import_module("transformers.modeling_flash_attention_utils")
    except ImportError:
        yield False
        return
    if not all(hasattr(utils, name) for name in KERNELS):
        yield False
        return
    names = [*KERNELS, "_process_flash_kwargs_fn", "_loaded_implementation", "_flash_with_kvcache_fn",
             "_process_with_kvcache_kwargs_fn"]  # fmt: skip
    saved = {name: getattr(utils, name) for name in names if hasattr(utils, name)}
    process = utils._lazy_define_process_function(flash_attn_varlen_func)
    ours = {
        "_flash_fn": flash_attn_func,
        "_flash_varlen_fn": flash_attn_varlen_func,
        "_pad_fn": utils._pad_input,
        "_unpad_fn": utils._unpad_input,
        "_process_flash_kwargs_fn": process,
        "_loaded_implementation": FLASH,
        "_flash_with_kvcache_fn": None,
        "_process_with_kvcache_kwargs_fn": dict,
    }
    for name in saved:
        setattr(utils, name, ours[name])
    try:
        yield True
    finally:
        for name, value in saved.items():
            setattr(utils, name, value)


def use_flash(model: Any) -> Any:
    """``model`` (built with eager attention) switched to the flash-attention integration, its own checks
    of an installed flash_attn package aside."""
    for config in {id(c): c for c in _configs(model.config)}.values():
        config._attn_implementation = FLASH
        # fp32 on the CPU: transformers casts to the attention's Linear weights' dtype, and GPT-2's Conv1D
        # layers have none (StopIteration); a config that says "quantized" has it read from its dtype
        # (5.x: ``_is_quantized`` and ``dtype``; 4.x: ``_pre_quantization_dtype``)
        if not hasattr(config, "_is_quantized"):
            config._is_quantized = False
            config._pre_quantization_dtype = model.dtype
            if getattr(config, "dtype", None) is None:
                config.dtype = model.dtype
    return model


def _configs(config: Any) -> list:
    found = [config]
    get = getattr(config, "get_text_config", None)
    if get is not None:
        found.append(get(decoder=True))
    return found
