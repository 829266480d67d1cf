"""What hfpatch reads of transformers' source code (and of a model class outside it), in one room: a
function's source, its syntax tree, and the patterns looked for in them. Read once when a class is
patched, or a model first judged, never per call. Each reader returns what it found, or that it could
not read (source of a compiled or dynamically made function: :func:`source_of` gives None), and the
callers decide what that means for them."""

from __future__ import annotations

import ast
import functools
import inspect
import re
import sys
import textwrap
import threading
from typing import Any, Optional

__all__ = [
    "fills_positions_when_none",
    "attends_inline",
    "forward_tree",
    "hands_masks_on",
    "hands_positions_to_mask_functions",
    "hands_state",
    "held_states",
    "keeps_keys",
    "keeps_state",
    "passes_4d_mask_as_given",
    "pools_by_pad_id",
    "signature_of",
    "source_of",
    "state_mixers",
    "takes_mask_dict",
    "unreadable_with_mask_dict",
]

# ``if not isinstance(causal_mask_mapping := attention_mask, dict):``, whatever the name
# (the walrus in parentheses too: ast.unparse writes it so)
_TAKES_DICT = re.compile(r"isinstance\(\s*\(?\s*\w+\s*:=\s*attention_mask\s*\)?\s*,\s*dict\s*\)")
# (4.41-4.43 first check the mask is additive: ``if attention_mask.max() != 0: raise ValueError(...)``)
_2D_ONLY = re.compile(r"if attention_mask\.dim\(\) == 2:")
_AS_GIVEN = re.compile(
    r"(?:dim\(\)|ndim) == 4:(?:\s*#[^\n]*)*"
    r"(?:\s*if attention_mask\.max\(\) != 0:\s*raise ValueError\([^\n]*\))?"
    r"\s*causal_mask = attention_mask\b"
)
_NONE_CHECK = re.compile(r"\bposition_ids\s+is\s+(not\s+)?None\b")
# a call of masking_utils' mask functions that passes the positions (or a dict of their arguments with them)
# (or the one it picked: ``mask_function = create_causal_mask if ... else create_sliding_window_causal_mask``)
_HANDS_POSITIONS = re.compile(
    r"(?:create_(?:causal|sliding_window_causal|chunked_causal)_mask|mask_function)\((?:[^()]|\([^()]*\))*"
    r"position_ids|[\"']position_ids[\"']\s*:\s*position_ids"
)


# a layer that reads or writes its state through the cache it is given: 5.x's linear-attention cache
# layers (``cache.get_conv_state(...)``), 4.x's per-layer lists (``cache_params.ssm_states[...]``), MiniMax's
_STATE_ACCESS = re.compile(
    r"\b(?:cache|cache_params|past_key_values)\.(?:get_conv_state|get_recurrent_state|update_conv_state"
    r"|update_recurrent_state|conv_states|ssm_states|recurrent_states|conv_cache|get_linear_cache"
    r"|set_linear_cache)\b"
)


# source is read and parsed under one lock: CPython 3.11's AST constructor keeps a recursion count that two
# threads compiling at once corrupt (SystemError: "AST constructor recursion depth mismatch"), and a class's
# first call in each of two threads reads its module's source (inspect.getsource parses it for a class)
_PARSING = threading.RLock()


def source_of(function: Any) -> Optional[str]:
    """The source of ``function`` (unwrapped: a decorated forward's own), or None where it has none."""
    try:
        with _PARSING:
            return inspect.getsource(inspect.unwrap(function))
    except (OSError, TypeError, ValueError):
        return None


def _parse(source: str) -> ast.Module:
    with _PARSING:
        return ast.parse(source)


def forward_tree(function: Any) -> Optional[ast.AST]:
    """The syntax tree of ``function``'s source, or None where it cannot be read."""
    source = source_of(function)
    if source is None:
        return None
    try:
        return _parse(textwrap.dedent(source))
    except SyntaxError:
        return None


def attends_inline(module: Any) -> bool:
    """A modeling module whose attention calls SDPA itself (``scaled_dot_product_attention(``), not
    through its ``ALL_ATTENTION_FUNCTIONS``, or whose source cannot be read."""
    source = source_of(module)
    return source is None or "scaled_dot_product_attention(" in source


# what a layer may do with the mask it is handed and still hand it on untouched
_HARMLESS = {"shape", "device", "size", "dim", "ndim"}


def hands_masks_on(module: Any, owner: type) -> bool:
    """Whether every class of ``module`` but ``owner`` (whose forward makes the masks from the 2-D one)
    hands the mask it is given (``attention_mask``) on untouched: passes it to calls, compares it with None,
    reads its shape, and nothing else (no dtype branch, no index, no arithmetic: DeepSeek V3.2's indexer,
    Doge's dynamic mask). ``eager_attention_forward`` aside: it is the attention. False where the source
    cannot be read."""
    tree = forward_tree(module)
    if tree is None:
        return False
    skipped = {
        id(inner)
        for node in ast.walk(tree)
        if (isinstance(node, ast.ClassDef) and node.name == owner.__name__)
        or (isinstance(node, ast.FunctionDef) and node.name == "eager_attention_forward")
        for inner in ast.walk(node)
    }
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Attribute) and _is_mask(node.value) and node.attr not in _HARMLESS:
            return False
        if isinstance(node, ast.Subscript) and _is_mask(node.value):
            return False
        if isinstance(node, (ast.BinOp, ast.UnaryOp, ast.BoolOp)) and any(
            _is_mask(child) for child in ast.iter_child_nodes(node)
        ):
            return False
        if isinstance(node, ast.Compare) and any(_is_mask(x) for x in (node.left, *node.comparators)):
            if not all(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
                return False
        if isinstance(node, ast.Call) and any(_is_mask(arg) for arg in node.args):
            function = node.func
            torch_call = isinstance(function, ast.Attribute) and isinstance(function.value, ast.Name)
            if torch_call and function.value.id in ("torch", "F"):
                return False
    return True


def _is_mask(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == "attention_mask"


def takes_mask_dict(source: str) -> bool:
    """A forward that takes ``{layer_type: mask}`` as its ``attention_mask`` (4.53+)."""
    return bool(_TAKES_DICT.search(source))


def passes_4d_mask_as_given(source: str) -> bool:
    """Mask code that uses a 4-D ``attention_mask`` as it is (``causal_mask = attention_mask``)."""
    return bool(_AS_GIVEN.search(source))


def reads_2d_mask_only(source: str) -> bool:
    """Mask code that builds its causal mask itself and reads a given mask only where it is 2-D, a 4-D one
    silently ignored (Jamba, Zamba, Zamba2 up to 4.57-5.x)."""
    return bool(_2D_ONLY.search(source)) and not passes_4d_mask_as_given(source)


def fills_positions_when_none(source: str) -> bool:
    """A forward that computes positions itself where none are given (it compares them with None)."""
    return bool(_NONE_CHECK.search(source))


def hands_positions_to_mask_functions(source: str) -> bool:
    """A forward that passes its positions to masking_utils' mask functions (which then find the packed
    sequences in them)."""
    return bool(_HANDS_POSITIONS.search(source))


def pools_by_pad_id(source: str) -> bool:
    """A head that picks the token it pools by ``config.pad_token_id`` (a sequence-classification head:
    the last token whose id is not the pad id, whatever the mask says)."""
    return "pad_token_id" in source


def unreadable_with_mask_dict(source: str) -> bool:
    """Whether a forward that builds its masks unless given a ``{layer_type: mask}`` dict reads, outside
    that block, a name only the block assigns: given the dict, it would raise (T5Gemma 2's decoder on
    5.4-5.14 defines a mask function there and uses it for the cross-attention mask)."""
    try:
        forward = _parse(textwrap.dedent(source)).body[0]
    except SyntaxError:  # source this cannot read: assume the dict is taken, as the forward says
        return False

    def names(nodes: Any, context: type) -> set[str]:
        return {node.id for node in nodes if isinstance(node, ast.Name) and isinstance(node.ctx, context)}

    for block in ast.walk(forward):
        if isinstance(block, ast.If) and _TAKES_DICT.search(ast.unparse(block.test)):
            inner = list(ast.walk(block))
            mine = {id(node) for node in inner}
            outer = [node for node in ast.walk(forward) if id(node) not in mine]
            only_here = names(inner, ast.Store) - names(ast.walk(block.test), ast.Store)
            return bool((only_here - names(outer, ast.Store)) & names(outer, ast.Load))
    return False


def state_mixers(module: Any) -> list[type]:
    """The classes of a modeling module whose ``forward`` takes the call's tokens first and carries a
    state from token to token through the cache it is given (a convolution's window, an SSM's, a gated
    delta rule's, a linear attention's: read or written in the class's code, or in a function of the module
    it calls, as 5.25's ``causal_conv1d_forward``): what :mod:`hfpatch.mixers` runs by sequence. And a
    model's layers (its ``_no_split_modules``) handed the state itself as their
    ``state`` and returning it (RWKV's, xLSTM's: the model threads a list or tuple of tensors through
    them); and a layer that keeps its state on itself, made by its own ``_setup_cache`` (RecurrentGemma's
    recurrent block: :func:`held_states`)."""
    found: list[type] = []
    if module is None:
        return found
    stateful = {  # (the model's layers; 5.24 marked the model ``_is_stateful``, 5.25 dropped the flag)
        name
        for value in vars(module).values()
        if isinstance(value, type)
        for name in getattr(value, "_no_split_modules", None) or ()
    }
    functions = _module_functions(module)  # (by their source: a decorator may make one a module, 5.25's)
    names = {name for name, source in functions.items() if _STATE_ACCESS.search(source)}
    for _ in range(2):  # (and a function of the module that calls one)
        calls = _calling(names)
        names |= {name for name, source in functions.items() if calls and calls.search(source)}
    calls = _calling(names)
    for value in vars(module).values():
        if (
            not isinstance(value, type)
            or value.__module__ != module.__name__
            or "forward" not in value.__dict__
        ):
            continue
        source = source_of(value)
        try:
            params = list(signature_of(value.__dict__["forward"]).parameters)
        except (TypeError, ValueError):
            continue
        if value.__name__ in stateful and "state" in params:
            found.append(value)
            continue
        if len(params) > 1 and held_states(value) and not _reads(value.__dict__["forward"], "attention_mask"):
            found.append(value)  # (not an attention that keeps its keys on itself: 4.x RecurrentGemma's)
            continue
        if source is None or not (_STATE_ACCESS.search(source) or (calls and calls.search(source))):
            continue
        model = any(getattr(base, "base_model_prefix", None) is not None for base in value.__mro__)
        if not model and any(name in params for name in ("cache", "cache_params", "past_key_values")):
            found.append(value)  # (a model class threads the cache through its layers: not a mixer)
    return found


@functools.cache
def held_states(cls: type) -> tuple[tuple[str, ...], ...]:
    """The attributes a layer keeps its state in, on itself or its children, as its own ``_setup_cache``
    sets them (``self.conv1d_state``, ``self.rg_lru.recurrent_states``: paths from the layer), read from its
    code; empty for a class without one."""
    method = cls.__dict__.get("_setup_cache")
    tree = forward_tree(method) if method is not None else None
    found: list[tuple[str, ...]] = []
    for node in ast.walk(tree) if tree is not None else ():
        for target in node.targets if isinstance(node, ast.Assign) else ():
            path = []
            while isinstance(target, ast.Attribute):
                path.insert(0, target.attr)
                target = target.value
            if isinstance(target, ast.Name) and target.id == "self" and path and tuple(path) not in found:
                found.append(tuple(path))
    return tuple(found)


def keeps_keys(module: Any) -> bool:
    """A modeling module whose attention keeps its keys on itself (made by its own ``_setup_cache``, a
    window of its own: RecurrentGemma's before 5.4), where no mask by sequence reaches them."""
    return (
        any(
            isinstance(value, type)
            and value.__module__ == module.__name__
            and "forward" in value.__dict__
            and held_states(value)
            and _reads(value.__dict__["forward"], "attention_mask")
            for value in vars(module).values()
        )
        if module is not None
        else False
    )


def hands_state(model: Any) -> bool:
    """Whether ``model``'s layers that carry a state are handed the state itself (RWKV's, xLSTM's)."""
    return _own_states(type(model))[0]


def keeps_state(model: Any) -> bool:
    """Whether ``model``'s layers that carry a state keep it on themselves (RecurrentGemma's)."""
    return _own_states(type(model))[1]


@functools.cache
def _own_states(cls: type) -> tuple[bool, bool]:
    found = state_mixers(sys.modules.get(cls.__module__))
    handed = any("state" in signature_of(c.__dict__["forward"]).parameters for c in found)
    return handed, any(held_states(c) for c in found)


def _reads(function: Any, name: str) -> bool:
    """Whether ``function``'s code reads ``name`` (a parameter it takes and uses), or cannot be read."""
    tree = forward_tree(function)
    if tree is None:
        return True
    loads = (n for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load))
    return any(n.id == name for n in loads)


def _calling(names: set[str]) -> Optional[re.Pattern]:
    """A call of any of ``names`` (None for none)."""
    return re.compile(r"\b(?:{})\(".format("|".join(map(re.escape, sorted(names))))) if names else None


def _module_functions(module: Any) -> dict[str, str]:
    """The source of each function a module defines at its top level, by name (empty where unreadable)."""
    source = source_of(module)
    if source is None:
        return {}
    try:
        tree = _parse(source)
    except SyntaxError:
        return {}
    return {
        node.name: ast.get_source_segment(source, node) or ""
        for node in tree.body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    }


def signature_of(function: Any) -> inspect.Signature:
    """``function``'s own signature, through a decorator that hides it (``*args, **kwargs`` and the function
    in its closure, without ``functools.wraps``: 5.13's ``force_accelerate_hooks``)."""
    found = inspect.signature(function)
    kinds = {p.kind for p in list(found.parameters.values())[1:]}
    if kinds == {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}:
        for cell in getattr(function, "__closure__", None) or ():
            inner = cell.cell_contents
            if inspect.isfunction(inner) and inner is not function:
                return signature_of(inner)
    return found
