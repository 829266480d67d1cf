"""Llama: rotary positions. A uniform left-pad shift cancels out, but the holes of a padded cached
prefix do not; 4.39-4.40 also raise without ``cache_position`` when given a ``StaticCache``."""

from ..engine import register
from ..gates import Adapter

ADAPTER = register(
    Adapter(
        arch="llama",
        module="transformers.models.llama.modeling_llama",
        cls="LlamaModel",
        versions=">=4.28,<=5.24.0",
        why="LlamaModel first shipped in 4.28.0; tested through 5.24",
        attached_cache="layers.0.self_attn.past_key_value",  # 4.38-4.40 model._setup_cache(StaticCache, ...)
        upstream_bugs=(
            (
                ">=4.36,<4.38",
                "SDPA attention gives wrong logits (or an IndexError) for some padded, cached batches, "
                "with or without hfpatch (transformers' _unmask_unattended); use attn_implementation='eager'",
            ),
        ),
    )
)
