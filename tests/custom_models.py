"""Models that follow transformers' conventions without being its classes, built at test time (never
committed): copies of the installed transformers' own modeling files with every class renamed (as
remote-code checkpoints are), written as a package, imported, registered through the Auto classes or
saved as a checkpoint directory with ``auto_map`` for ``trust_remote_code=True``; and one small causal
LM with learned absolute positions written from scratch (:data:`FROM_SCRATCH`)."""

from __future__ import annotations

import importlib
import inspect
import itertools
import re
import sys
from pathlib import Path
from typing import Any

import torch

from hfpatch.verification.tiny import INIT, SIZES, shrunk_config

_COUNT = itertools.count()
# model type: (its package in transformers.models, the prefix of its class names)
COPIES = {"gpt2": ("gpt2", "GPT2"), "llama": ("llama", "Llama"), "qwen2": ("qwen2", "Qwen2")}


def _rewritten(source: str, prefix: str, new_prefix: str, package: str, new_package: str) -> str:
    """A transformers modeling or configuration file as a package of its own: absolute imports of
    transformers, every class of ``prefix`` renamed, its own model type."""
    # (indented ones too: the imports inside ``if is_flash_attn_2_available():`` and the like, which
    # transformers' remote-code loader reads wherever they stand)
    source = re.sub(r"^([ \t]*)from \.\.\. import", r"\1from transformers import", source, flags=re.M)
    source = re.sub(r"^([ \t]*)from \.\.\.(\w)", r"\1from transformers.\2", source, flags=re.M)
    source = re.sub(r"^([ \t]*)from \.\.(\w)", r"\1from transformers.models.\2", source, flags=re.M)
    source = re.sub(rf"^([ \t]*)from \.configuration_{package} import",
                    rf"\1from .configuration_{new_package} import", source, flags=re.M)  # fmt: skip
    source = re.sub(rf"\b{prefix}(?=[A-Z])", new_prefix, source)  # classes (not constants: GPT2_...)
    return re.sub(rf"model_type = \"{package}\"", f'model_type = "{new_package}"', source)


def write_copy(model_type: str, root: Path) -> tuple[str, str, str]:
    """Write a renamed copy of ``model_type``'s files as a package under ``root``: (the package name,
    its new model type, the class prefix)."""
    package, prefix = COPIES[model_type]
    n = next(_COUNT)
    new_prefix, new_package = f"Copy{n}{prefix}", f"copy{n}{package}"
    folder = root / new_package
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text("")
    for kind in ("configuration", "modeling"):
        module = importlib.import_module(f"transformers.models.{package}.{kind}_{package}")
        text = _rewritten(inspect.getsource(module), prefix, new_prefix, package, new_package)
        (folder / f"{kind}_{new_package}.py").write_text(text)
    return new_package, new_package, new_prefix


def import_copy(model_type: str, root: Path) -> tuple[Any, Any, str]:
    """(its configuration module, its modeling module, its model type), imported from ``root``."""
    package, new_type, _ = write_copy(model_type, root)
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    configuration = importlib.import_module(f"{package}.configuration_{package}")
    modeling = importlib.import_module(f"{package}.modeling_{package}")
    return configuration, modeling, new_type


def classes(module: Any, suffix: str) -> Any:
    """The class of ``module`` (a copy) whose name is its prefix + ``suffix``."""
    return next(v for k, v in vars(module).items() if k.startswith("Copy") and k.endswith(suffix))


def tiny(config_class: type, **extra: Any) -> Any:
    """A tiny config of a copy; windows wider than the tests' rows (positions are what is measured)."""
    config = shrunk_config(
        config_class, config_class(), {}, {**SIZES, "sliding_window": 64, "attention_chunk_size": 64}
    )
    config.initializer_range = INIT
    for name, value in extra.items():
        setattr(config, name, value)
    return config


def built(cls: type, config: Any, seed: int = 0) -> Any:
    torch.manual_seed(seed)
    return cls(config).float().eval()


# A causal LM written from scratch as a user would: learned absolute positions, transformers' cache
# object, ``position_ids`` counted from the cache when not given (transformers' default, and its bug)
FROM_SCRATCH = """
import torch
from torch import nn
from transformers import DynamicCache, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast


class ScratchConfig(PretrainedConfig):
    model_type = "MODEL_TYPE"

    def __init__(self, vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 max_position_embeddings=128, initializer_range=0.02, **kwargs):
        self.vocab_size, self.hidden_size, self.num_hidden_layers = vocab_size, hidden_size, num_hidden_layers
        self.num_attention_heads, self.max_position_embeddings = num_attention_heads, max_position_embeddings
        self.initializer_range = initializer_range
        super().__init__(**kwargs)


class ScratchBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        width, self.heads = config.hidden_size, config.num_attention_heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x, allowed, cache, index):
        batch, new, width = x.shape
        qkv = self.qkv(self.norm1(x)).chunk(3, -1)
        q, k, v = (t.view(batch, new, self.heads, -1).transpose(1, 2) for t in qkv)
        if cache is not None:
            k, v = cache.update(k, v, index)
        attended = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        x = x + self.out(attended.transpose(1, 2).reshape(batch, new, width))
        return x + self.mlp(self.norm2(x))


class ScratchLM(PreTrainedModel):
    config_class = ScratchConfig

    def __init__(self, config):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.positions = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.blocks = nn.ModuleList(ScratchBlock(config) for _ in range(config.num_hidden_layers))
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(0.0, self.config.initializer_range)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                use_cache=None, inputs_embeds=None, **kwargs):
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + x.shape[1], device=x.device)[None]
        x = x + self.positions(position_ids)
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache()
        keys = torch.arange(past + x.shape[1], device=x.device)
        allowed = keys[None, :] <= (keys[past:, None])
        if attention_mask is not None:
            allowed = allowed[None] & attention_mask[:, None, :].bool()
            allowed = allowed[:, None]
        for index, block in enumerate(self.blocks):
            x = block(x, allowed, past_key_values, index)
        return CausalLMOutputWithPast(logits=self.head(x), past_key_values=past_key_values)
"""


def import_scratch(root: Path, source: str = FROM_SCRATCH) -> tuple[Any, str]:
    """Write ``source`` (the from-scratch model, or a variant of it) as a module under ``root`` and import
    it: (the module, its model type)."""
    n = next(_COUNT)
    name, model_type = f"scratch{n}", f"scratch_lm{n}"
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{name}.py").write_text(source.replace("MODEL_TYPE", model_type))
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return importlib.import_module(name), model_type
