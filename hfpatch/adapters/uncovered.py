"""Decoder-only model types that hfpatch knows and does not patch, each with the reason measured on
transformers 5.24.0 (docs/architectures.md): ``status()`` lists them, ``apply()``
never touches them, ``verify()`` still probes them."""

from ..declarations import NOT_COVERED, NOT_FIXABLE, Undeclared

ENCODER_AS_DECODER = "an encoder whose causal-LM head runs it as a decoder (is_decoder=True): not measured (BERT's is patched: bert)"
CACHE_COLUMNS = (
    "position_ids have no effect: a relative bias counts cache columns, and short convolutions see pads"
)

# fmt: off
UNDECLARED = (
    Undeclared("inkling_text", NOT_FIXABLE, CACHE_COLUMNS),
    Undeclared("inkling2_text", NOT_FIXABLE, CACHE_COLUMNS),
    Undeclared("inkling2_loop_text", NOT_FIXABLE, CACHE_COLUMNS),
    Undeclared("mpt", NOT_FIXABLE, "ALiBi from the distance between cache columns (no position_ids): a hole adds distance"),
    Undeclared("git", NOT_FIXABLE, "GitModel prepends image columns to a 2-D mask in cached calls, misaligning it"),
    Undeclared("blt", NOT_FIXABLE, "hash n-gram byte embeddings see pads (and cached calls fail upstream on 5.24)"),
    Undeclared("cpmant", NOT_FIXABLE, "CPM-Ant ignores attention_mask: even right padding in one call is wrong"),
    Undeclared("reformer", NOT_FIXABLE, "axial position embeddings fail on positions that are not one increasing run"),
    Undeclared("gemma3n", NOT_COVERED, "not measured (its vision tower needs timm); its text model, gemma3n_text, is patched"),
    Undeclared("gemma4_assistant", NOT_COVERED, "a drafter that needs the target model's states: not a standalone LM"),
    Undeclared("gemma4_unified_assistant", NOT_COVERED, "a drafter that needs the target model's states: not a standalone LM"),
    Undeclared("musicgen", NOT_COVERED, "an audio-codebook decoder: its inputs are EnCodec codes, not text"),
    Undeclared("musicgen_melody", NOT_COVERED, "an audio-codebook decoder: its inputs are EnCodec codes, not text"),
    # the causal-LM mapping's encoders whose LM head runs as a decoder (is_decoder=True), and two others
    *(Undeclared(arch, NOT_COVERED, ENCODER_AS_DECODER) for arch in (
        "bert-generation", "big_bird", "camembert", "data2vec-text", "electra", "ernie", "megatron-bert",
        "rembert", "roberta", "roberta-prelayernorm", "roc_bert", "roformer", "xlm-roberta", "xlm-roberta-xl",
        "xmod",
    )),
    Undeclared("trocr", NOT_COVERED, "TrOCR's text decoder (of a vision encoder-decoder model): not measured"),
    # mapped by older releases only (removed in 5.0 unless said)
    Undeclared("qdqbert", NOT_COVERED, f"{ENCODER_AS_DECODER}; mapped up to 4.57"),
    Undeclared("mega", NOT_COVERED, "MEGA's moving-average gated attention (a state across tokens): not measured; mapped up to 4.57"),
    Undeclared("open-llama", NOT_COVERED, "its own copy of an early Llama: not measured; mapped up to 4.57"),
    Undeclared("transfo-xl", NOT_COVERED, "Transformer-XL: relative positions over its memory (mems), no attention mask: not measured; mapped up to 4.57"),
    Undeclared("code_llama", NOT_COVERED, "no model is of this type (Code Llama checkpoints are llama, patched by the 'llama' adapter): an entry of the causal-LM mapping up to 5.5"),
    Undeclared("xlm", NOT_COVERED, "XLM's causal mode (a masked LM's, with language embeddings): not measured"),
    Undeclared("xlnet", NOT_COVERED, "XLNet: a permutation LM whose positions are relative to its memory (mems): not measured"),
)
# fmt: on
