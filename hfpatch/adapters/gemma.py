"""Gemma: rotary positions, like Llama (it never raised for a missing ``cache_position``)."""

from ..engine import register
from ..gates import Adapter

ADAPTER = register(
    Adapter(
        arch="gemma",
        module="transformers.models.gemma.modeling_gemma",
        cls="GemmaModel",
        versions=">=4.38,<=5.24.0",
        why="GemmaModel first shipped in 4.38.0; tested through 5.24",
        attached_cache="layers.0.self_attn.past_key_value",  # 4.38-4.40 model._setup_cache(StaticCache, ...)
    )
)
