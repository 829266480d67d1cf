"""Counting what a call costs, without a clock (tests/test_per_call_cost.py asserts with them;
benchmarks/depth.py prints them at more depths): the host reads of a call (counted at torch's Python API,
as a device would sync on them) and the Python frames of a decode step (``sys.setprofile``), on tiny
Llama and GPT-2 of any depth.

A host read is an op that needs a tensor's values on the host: ``item``, ``tolist``, ``nonzero``,
``bool()``, boolean-mask indexing, ``.cpu()`` ... On a GPU each is a device sync when the tensor lives on
the device. On this machine every tensor is on the host, so two counts are kept: every read (hfpatch's
work on its own host copy included), and the reads of tensors that would be on a device, where the
copies ``.cpu()`` makes (the call's one read) and everything computed from them are the host's."""

from __future__ import annotations

import gc
import inspect
import sys
import weakref
from collections import Counter
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

READS = {"item", "tolist", "nonzero", "__bool__", "__int__", "__float__", "__index__", "numpy", "unique",
         "unique_consecutive", "masked_select", "argwhere", "cpu"}  # fmt: skip
INDEXING = {"__getitem__", "__setitem__", "index_put_", "index_put"}


class HostReads(TorchFunctionMode):
    """Counts the host reads inside the block: ``every`` (each read op) and ``device`` (those of a tensor
    that is not a host copy: a ``.cpu()`` result or computed from one)."""

    def __init__(self) -> None:
        super().__init__()
        self.every, self.device = Counter(), Counter()
        self._host: dict[int, weakref.ref] = {}  # the host's tensors, by id (a tensor's == is elementwise)

    def on_host(self, tensor: torch.Tensor) -> bool:
        made = self._host.get(id(tensor))
        return made is not None and made() is tensor

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        read = [args[0]] if name in READS and args and isinstance(args[0], torch.Tensor) else []
        if name in INDEXING and len(args) > 1:
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            read = [i for i in index if isinstance(i, torch.Tensor) and i.dtype == torch.bool]
        for tensor in read:
            self.every[name] += 1
            if not self.on_host(tensor):
                self.device[name] += 1
        out = func(*args, **kwargs)
        # what .cpu() returns is the host's (here: the tensor itself, a copy on a GPU), and what is made
        # from the host's (not .to(): a copy to the device; here the tensor itself, which stays the host's)
        if name == "cpu" or (name != "to" and any(self.on_host(t) for t in inputs)):
            for value in tree_flatten(out)[0]:
                if isinstance(value, torch.Tensor):
                    self._host[id(value)] = weakref.ref(value)
        return out


def llama(layers: int):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def gpt2(layers: int):
    import transformers

    config = transformers.GPT2Config(vocab_size=100, n_embd=32, n_layer=layers, n_head=4, n_positions=256)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()


LENGTHS = (7, 3, 5)


def packed_call() -> dict:
    ids = torch.randint(3, 100, (2, sum(LENGTHS)), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None].expand(2, -1)
    return {"input_ids": ids, "position_ids": positions}


def padded_call() -> dict:
    ids = torch.randint(3, 100, (3, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[0, 7:] = 0
    mask[1, 3:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def reads(model, kwargs: dict) -> HostReads:
    with torch.no_grad():
        model(**kwargs, use_cache=False)  # (a first call: what is read once a process is not counted)
        with HostReads() as counted:
            model(**kwargs, use_cache=False)
    return counted


def make_dynamic_cache(model: Any) -> Any:
    import transformers

    if "config" in inspect.signature(transformers.DynamicCache.__init__).parameters:
        return transformers.DynamicCache(config=model.config)
    return transformers.DynamicCache()


def frames(model, passed: bool) -> int:
    """The Python frames of one decode step (a left-padded batch of two, one new token each, on a
    DynamicCache), the caller's positions ``passed`` or not; the step's second run counted (what a
    process does once, a warning or a cache of its own, is not a step's)."""
    _frames(model, passed)
    return _frames(model, passed)


def _frames(model, passed: bool) -> int:
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, :3] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        prefix = model(input_ids=ids[:, :8], attention_mask=mask[:, :8], position_ids=positions[:, :8],
                       past_key_values=make_dynamic_cache(model), use_cache=True)  # fmt: skip
        step = {"input_ids": ids[:, 8:], "attention_mask": mask, "past_key_values": prefix.past_key_values}
        if passed:
            step["position_ids"] = positions[:, 8:]
        count = [0]

        def profile(frame, event, arg):
            if event == "call":
                count[0] += 1

        gc.disable()  # (a collection inside the step would count the finalizers it runs)
        sys.setprofile(profile)
        try:
            model(**step, use_cache=True)
        finally:
            sys.setprofile(None)
            gc.enable()
    return count[0]
