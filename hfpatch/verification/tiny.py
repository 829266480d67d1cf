"""Tiny random-weight models of any model type, built from its config alone (nothing is downloaded):
what ``python -m hfpatch`` (the doctor) and ``hfpatch.verify("qwen2")`` run on.

Every config field of the names in :data:`SIZES` that the config class has is shrunk (2 layers, hidden
64, 4 heads, 2 KV heads, vocab 97, pad id 0, sliding windows and attention chunks of 4 tokens),
sub-configs (text, vision, audio) alike; :data:`OVERRIDES`
adds what a few model types need on top to build, or to have every kind of layer.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any, Optional

__all__ = [
    "OVERRIDES",
    "SEQ2SEQ_OVERRIDES",
    "SEQ2SEQ_SIZES",
    "SIZES",
    "WIDE",
    "MULTIMODAL_OVERRIDES",
    "seq2seq_auto_class",
    "shrunk_config",
    "tiny_config",
    "tiny_model",
    "tiny_multimodal",
    "tiny_seq2seq",
]

PAD = 0  # pad id; most tiny models' embedding row for it is zero (padding_idx), as in real checkpoints
VOCAB = 97
INIT = 0.1  # larger than the usual 0.02, so that a wrong position shows as a clearly wrong logit

SIZES = {
    "vocab_size": VOCAB,
    "hidden_size": 64, "n_embd": 64, "d_model": 64,
    "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2,
    "num_attention_heads": 4, "n_head": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "max_position_embeddings": 128, "n_positions": 128, "n_ctx": 128,
    "sliding_window": 4, "attention_chunk_size": 4,  # shorter than the scenarios: windows are probed
    "initializer_range": INIT,
    "pad_token_id": PAD, "bos_token_id": 1, "eos_token_id": 2,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
    "kv_lora_rank": 32, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
    # gated delta-rule layers (Qwen3.5, Qwen3-Next: 16 x 128 key heads by default)
    "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    # Mamba2 layers (Bamba, GraniteMoeHybrid, Nemotron-H, Zamba2: 128 heads x 64 by default, and a scan over
    # chunks of 256 whose intermediates are GiBs): 8 heads x 16 (hidden 64 x expand 2), states of 16
    "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_num_heads": 8, "mamba_head_dim": 16, "mamba_headdim": 16,
    "mamba_d_state": 16, "ssm_state_size": 16, "mamba_chunk_size": 16,
    # Jamba (before 5.2) and Zamba (before 5.15) raise without mamba-ssm's CUDA kernels: their torch path
    "use_mamba_kernels": False,
}  # fmt: skip

_SUB_CONFIGS = ("text_config", "vision_config", "audio_config")

# transformers 5.0.0's configs of these dropped pad_token_id, which their models still read (a
# checkpoint's config.json sets it; a config built from defaults does not)
_PAD_ID = {"pad_token_id": PAD}
_GEMMA4 = {"global_head_dim": 32, "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 16}
_HYBRID = {"layer_types": ["linear_attention", "full_attention"]}
_QWEN4_EXP = {
    # (its config names full attention as the release does: qwen_sparse_attention on 5.16-5.17, then indexed)
    "layer_types": ["linear_attention", "full_attention"], "indexer_n_heads": 2, "indexer_kv_heads": 1,
    "indexer_head_dim": 16, "indexer_budget": 64, "indexer_compress_ratio": 4,
}  # fmt: skip
# for a model whose windows hfpatch leaves to transformers: windows longer than every scenario
WIDE = {"sliding_window": 64, "attention_chunk_size": 64}

# per model type (an adapter's own; its aliases that wrap its text model get them in their text config)
# fmt: off
OVERRIDES: dict[str, dict[str, Any]] = {
    "axk1": {"head_dim": 8, "n_group": 2, "topk_group": 1},
    "bert": {"is_decoder": True},  # BertLMHeadModel as a decoder (its adapter's class)
    "codegen": {"rotary_dim": 8},
    "cohere_compass_text": {
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}},
    },
    "dbrx": {
        "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        "ffn_config": {"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2},
    },
    "deepseek_v2": {"num_experts_per_tok": 2, "head_dim": 8},
    "deepseek_v3": {"head_dim": 8},
    "dory": {"n_input_layers": 1, "n_output_layers": 1, "n_recurrent_layers": None},
    "dots1": {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1},
    "dots3_note_text": {
        "layer_types": ["indexed_attention", "sliding_attention"], "index_n_heads": 2, "index_head_dim": 16,
        "per_layer_config": {},
        "vision_config": {"per_layer_config": None, "adapter_in_dim": 64, "adapter_out_dim": 64},
        "audio_config": {"adapter_input_size": 64, "adapter_out_dim": 64},
    },
    "exaone4": _PAD_ID,
    "kolibri1_1": {
        "layer_types": ["indexed_attention", "sliding_attention"], "index_layers": [0], "index_num_heads": 2,
        "index_topk": 8, "index_pool_size": 128, "index_compression": 2, "index_num_local_tokens": 2,
        "index_num_sink_tokens": 1,
    },
    "flint": {"layer_types": ["sliding_attention", "full_attention"]},
    "gemma3n_text": {
        "num_hidden_layers": 4, "layer_types": ["sliding_attention", "full_attention"] * 2,
        "num_kv_shared_layers": 2, "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 16,
        "laurel_rank": 8,
    },
    "gemma4_text": _GEMMA4,
    "gemma4": _GEMMA4,
    "gemma4_unified_text": {"global_head_dim": 32},
    "gemma4_unified": {"global_head_dim": 32},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    "gptj": {"rotary_dim": 8},
    "hunyuan_v1_dense": {"head_dim": 16},
    "hunyuan_v1_moe": {"head_dim": 16},
    "jetmoe": _PAD_ID,
    "longcat_flash": {"head_dim": 8, "expert_ffn_hidden_size": 32, "zero_expert_num": 2},
    "minimax_m3_vl_text": {"layer_types": ["full_attention", "minimax_m3_sparse"]},
    "ministral": {"head_dim": 16},
    "nemotron": {"num_key_value_heads": 2},
    "phi": _PAD_ID,
    "recurrent_gemma": {
        "lru_width": 64, "block_types": ["recurrent", "attention"], "attention_window_size": 64,
    },
    "stablelm": _PAD_ID,
    "youtu": {"head_dim": 8},
    # models whose layers carry a state (hfpatch.mixers): a state layer and an attention layer each, where the
    # default 2-layer config has one kind only (a checkpoint has both)
    **{arch: _HYBRID for arch in (
        "bailing_hybrid", "granitemoehybrid", "olmo_hybrid", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next",
    )},
    "qwen3_5": {"text_config": _HYBRID},
    "qwen3_5_moe": {"text_config": _HYBRID},
    "bamba": {"attn_layer_indices": [1]},
    "falcon_h1": {"mamba_d_ssm": 128, "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_expand": 2},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1},
    "kimi_linear": {**_HYBRID, "linear_head_dim": 16, "linear_num_heads": 4},
    "lfm2": {"layer_types": ["conv", "full_attention"], "full_attn_idxs": [1]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "full_attn_idxs": [1], "num_dense_layers": 1},
    "lfm3": {"layer_types": ["conv", "full_attention"]},
    "qwen4_exp_text": _QWEN4_EXP,
    "qwen4_exp": {"text_config": _QWEN4_EXP},
    "zamba": {"num_hidden_layers": 3, "layers_block_type": ["linear_attention", "hybrid", "hybrid"]},
    "zamba2": {"layers_block_type": ["linear_attention", "hybrid"]},
    "zaya": {"num_experts_per_tok": 1},
    "mamba2": {"num_heads": 8, "head_dim": 16, "chunk_size": 16},
    "xlstm": {
        "num_heads": 4, "embedding_dim": 64, "num_blocks": 2, "chunk_size": 8, "qk_dim_factor": 1.0,
        "v_dim_factor": 1.0, "ffn_round_up_to_multiple_of": 16,
    },
    "rwkv": {"attention_hidden_size": 64, "intermediate_size": 128},
}
# fmt: on


def tiny_config(model_type: str, sizes: Optional[dict[str, Any]] = None) -> Any:
    """A tiny config of ``model_type`` (see the module docstring). ``sizes`` replaces some of
    :data:`SIZES` (same field names: the benchmarks' larger models)."""
    import transformers

    from ..engine import adapter_for

    adapter = adapter_for(model_type)
    name = adapter.arch if adapter is not None else model_type
    overrides = copy.deepcopy(OVERRIDES.get(name, {}))  # config classes edit what they are given
    default = transformers.AutoConfig.for_model(model_type)
    if name != model_type and hasattr(_field(default, "text_config"), "to_dict"):
        # an alias that wraps the patched text model: the adapter's own overrides are for its text config
        text = {key: overrides.pop(key) for key in list(overrides) if key not in _SUB_CONFIGS}
        overrides["text_config"] = {**text, **overrides.get("text_config", {})}
    return shrunk_config(type(default), default, overrides, {**SIZES, **(sizes or {})})


def tiny_model(
    model_type: str, seed: int = 0, attention: Optional[str] = None, sizes: Optional[dict[str, Any]] = None
) -> Any:
    """A tiny random-weight causal LM of ``model_type`` (:func:`tiny_config`), fp32, eval mode;
    ``attention``: ``"eager"`` or ``"sdpa"`` (default: the release's own default)."""
    import torch
    import transformers

    from ..engine import adapter_for
    from ..windows import configured_window, positional

    def build(sizes: Optional[dict[str, Any]]) -> Any:
        config = tiny_config(model_type, sizes)
        if attention is not None:
            config._attn_implementation = attention  # chosen at init; older releases read only this field
        torch.manual_seed(seed)
        return transformers.AutoModelForCausalLM.from_config(config).float().eval()

    model = build(sizes)
    adapter = adapter_for(model_type)
    if adapter is not None and configured_window(model) and not positional(model, adapter.cls):
        # windows this release decides by cache column (a declared limit, see ``hfpatch.verify``'s note):
        # a window longer than every scenario, so that the probe measures what positions fix
        model = build({**(sizes or {}), **WIDE})
    return model


# image-text-to-text models (tiny_multimodal), on top of SIZES: multimodal rope sections that fit a head
# of 16 (8 rotary pairs), a vision tower whose output width is the text model's, a small image grid
_MROPE = {"rope_scaling": {"rope_type": "default", "mrope_section": [2, 3, 3]}}
_VISION = {
    "out_hidden_size": 64, "depth": 1, "patch_size": 2, "spatial_merge_size": 2, "temporal_patch_size": 1,
}  # fmt: skip
# the Qwen-VL family's special tokens inside the tiny vocabulary: an image's tokens (96), framed by 95 and 94
_QWEN_VL = {
    "text_config": _MROPE, "image_token_id": 96, "video_token_id": 93, "vision_start_token_id": 95,
    "vision_end_token_id": 94,
}  # fmt: skip
# fmt: off
MULTIMODAL_OVERRIDES: dict[str, dict[str, Any]] = {
    "qwen2_vl": {**_QWEN_VL, "vision_config": {**_VISION, "embed_dim": 32, "num_heads": 2}},
    "qwen2_5_vl": {**_QWEN_VL, "vision_config": {**_VISION, "fullatt_block_indexes": [0]}},
    "qwen3_vl": {**_QWEN_VL, "vision_config": {**_VISION, "deepstack_visual_indexes": []}},
    # 5.0's Qwen3-VL-MoE and GLM-4V text configs have no pad_token_id of their own (their models read one)
    "qwen3_vl_moe": {
        **_QWEN_VL, "text_config": {**_MROPE, **_PAD_ID},
        "vision_config": {**_VISION, "deepstack_visual_indexes": []},
    },
    "glm4v": {"text_config": {**_MROPE, **_PAD_ID}, "vision_config": _VISION},
    "glm46v": {"text_config": {**_MROPE, **_PAD_ID}, "vision_config": _VISION},
    "glmga": {"text_config": {**_MROPE, **_PAD_ID}, "vision_config": _VISION},
    "paddleocr_vl": {"text_config": _MROPE, "vision_config": _VISION},
    "hunyuan_vl": {"text_config": {**_MROPE, "head_dim": 16}, "vision_config": _VISION},
    "exaone4_5": {"text_config": {**_PAD_ID, **WIDE}},  # windows stay transformers' (a declared limit)
    "chameleon": {"vocabulary_map": {"<image>": 96, "IMGIMG0": 95}, "image_token_id": 96},
    "granite_docling": {"vision_config": _VISION},
    "lfm2_vl": {"text_config": {"layer_types": ["conv", "full_attention"], "full_attn_idxs": [1]}},
    # an image of 28 x 28 pixels: 4 patches of 14, 4 image tokens (id 96)
    "llava": {
        "vision_config": {"image_size": 28, "patch_size": 14}, "image_token_id": 96, "image_token_index": 96,
    },
    "paligemma": {
        "vision_config": {"image_size": 28, "patch_size": 14, "projection_dim": 64}, "projection_dim": 64,
        "image_token_id": 96, "image_token_index": 96,
    },
}
# fmt: on


def tiny_multimodal(model_type: str, seed: int = 0, attention: Optional[str] = None) -> Any:
    """A tiny random-weight image-text-to-text model of ``model_type`` (its
    ``AutoModelForImageTextToText`` class): :data:`SIZES` and :data:`MULTIMODAL_OVERRIDES`, fp32, eval."""
    import torch
    import transformers

    default = transformers.AutoConfig.for_model(model_type)
    overrides = copy.deepcopy(MULTIMODAL_OVERRIDES.get(model_type, {}))
    config = shrunk_config(type(default), default, overrides, dict(SIZES))
    if attention is not None:
        config._attn_implementation = attention
        for name in _SUB_CONFIGS:
            sub = _field(config, name)
            if hasattr(sub, "to_dict"):
                sub._attn_implementation = attention
    torch.manual_seed(seed)
    return transformers.AutoModelForImageTextToText.from_config(config).float().eval()


# what encoder-decoder configs call their sizes, on top of SIZES (tiny_seq2seq); speech encoders get 16
# mel bins (Whisper: 32 frames, its max_source_positions doubled)
SEQ2SEQ_SIZES = {
    "encoder_layers": 2, "decoder_layers": 2, "num_decoder_layers": 2,
    "encoder_attention_heads": 4, "decoder_attention_heads": 4, "num_heads": 4,
    "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "d_ff": 128, "d_kv": 16,
    "max_target_positions": 128, "max_source_positions": 16, "num_mel_bins": 16, "input_feat_per_channel": 16,
    "decoder_start_token_id": 1, "forced_bos_token_id": None, "forced_eos_token_id": None, "init_std": 0.1,
    "encoder_num_hidden_layers": 2, "decoder_num_hidden_layers": 2,
    "encoder_num_attention_heads": 4, "decoder_num_attention_heads": 4,
    "encoder_num_key_value_heads": 4, "decoder_num_key_value_heads": 4,
    "subsampling_conv_channels": 16, "num_key_value_heads": 4,
    "sliding_window": 64,  # longer than the scenarios: a seq2seq decoder's window stays transformers'

}  # fmt: skip
# per model type, on top (untied LM heads give large logits at init: float noise would pass 1e-5)
# fmt: off
SEQ2SEQ_OVERRIDES: dict[str, dict[str, Any]] = {
    "dia": {
        "decoder_config": {
            "cross_hidden_size": 64, "cross_head_dim": 16, "cross_num_attention_heads": 4,
            "cross_num_key_value_heads": 4,
        },
        # 5.0-5.x set the decoder's special ids from these (a pad id past the tiny vocabulary otherwise)
        "pad_token_id": PAD, "bos_token_id": 1, "eos_token_id": 2,
    },
    "mt5": {"initializer_factor": 0.25},
    "moonshine_streaming": {"num_key_value_heads": 4},
    # BERT decoders by default: set up as from_encoder_decoder_pretrained does
    "encoder-decoder": {"decoder": {"is_decoder": True, "add_cross_attention": True}},
    "speech-encoder-decoder": {"decoder": {"is_decoder": True, "add_cross_attention": True}},
}
# fmt: on
_SEQ2SEQ_SUB_CONFIGS = (*_SUB_CONFIGS, "encoder_config", "decoder_config", "encoder", "decoder")


def tiny_seq2seq(model_type: str, seed: int = 0, attention: Optional[str] = None, **overrides: Any) -> Any:
    """A tiny random-weight encoder-decoder model of ``model_type`` (text-to-text where transformers has
    one, else speech-to-text), fp32, eval mode: :data:`SIZES` and :data:`SEQ2SEQ_SIZES` shrink it."""
    import torch
    import transformers

    default = transformers.AutoConfig.for_model(model_type)
    fields = {**SEQ2SEQ_OVERRIDES.get(model_type, {}), **overrides}
    config = shrunk_config(
        type(default), default, copy.deepcopy(fields), {**SIZES, **SEQ2SEQ_SIZES}, _SEQ2SEQ_SUB_CONFIGS
    )
    if attention is not None:
        config._attn_implementation = attention
    torch.manual_seed(seed)
    return seq2seq_auto_class(model_type).from_config(config).float().eval()


def seq2seq_auto_class(model_type: str) -> Any:
    """``AutoModelForSeq2SeqLM`` where transformers has a text-to-text class for ``model_type``, else
    ``AutoModelForSpeechSeq2Seq``."""
    import transformers
    from transformers.models.auto import modeling_auto

    text = getattr(modeling_auto, "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", {})
    return (
        transformers.AutoModelForSeq2SeqLM if model_type in text else transformers.AutoModelForSpeechSeq2Seq
    )


def shrunk_config(
    config_class: type,
    default: Any,
    overrides: dict,
    sizes: dict,
    sub_configs: tuple[str, ...] = _SUB_CONFIGS,
) -> Any:
    kwargs = {
        name: value
        for name, value in sizes.items()
        if _field(default, name) is not None and not _read_only(config_class, name)
    }
    if _field(default, "kv_lora_rank") is not None:  # MLA: one KV head per query head
        kwargs["num_key_value_heads"] = sizes["num_attention_heads"]
    params = inspect.signature(config_class.__init__).parameters
    for name in sub_configs:
        sub = _field(default, name)
        if sub is not None and hasattr(sub, "to_dict"):
            shrunk = shrunk_config(type(sub), sub, overrides.pop(name, {}), sizes, sub_configs)
            kwargs[name] = shrunk.to_dict()
        elif sub is None and name not in params:
            overrides.pop(name, None)  # a sub-config override for the wrapper an alias has (see tiny_config)
    kwargs.update(overrides)
    old = any("mamba" in (_field(default, name) or ()) for name in _LAYER_TYPE_FIELDS)
    try:
        return config_class(**(_spelt_old(kwargs) if old else kwargs))
    except ValueError:  # (a config that checks its layer types and has no default ones: 4.57's Granite)
        if old or kwargs == _spelt_old(kwargs):
            raise
        return config_class(**_spelt_old(kwargs))


def _spelt_old(kwargs: dict) -> dict:
    """Before 5.0 the hybrids' layer types were spelt ``mamba`` and ``attention``."""
    return {
        name: [_OLD_SPELLING.get(kind, kind) for kind in value]
        if name in _LAYER_TYPE_FIELDS and isinstance(value, list)
        else value
        for name, value in kwargs.items()
    }


_LAYER_TYPE_FIELDS = ("layer_types", "layers_block_type")
_OLD_SPELLING = {"linear_attention": "mamba", "full_attention": "attention"}


def _field(config: Any, name: str) -> Any:
    """``config.name`` (``None`` where the config has none); ``...`` for a per-layer field of a
    heterogeneous config, which raises on global access: the tiny config sets it for every layer."""
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001 - e.g. AmbiguousGlobalPerLayerAttributeError (not an AttributeError)
        return ...


def _read_only(config_class: type, name: str) -> bool:
    """A field the config class derives itself (a property without a setter): it cannot be passed."""
    attribute = inspect.getattr_static(config_class, name, None)
    return isinstance(attribute, property) and attribute.fset is None
