"""GPT-2: learned absolute position embeddings (``wpe``), so left padding and padded cached prefixes
both shift every real token's embedding. Positions from the mask fix both."""

from ..engine import register
from ..gates import Adapter

ADAPTER = register(
    Adapter(
        arch="gpt2",
        module="transformers.models.gpt2.modeling_gpt2",
        cls="GPT2Model",
        versions=">=4.20,<=5.24.0",
        why="tested from 4.20.1, the release of the original report, through 5.24",
    )
)
