"""Decoder-only model types that hfpatch knows and does not patch, each with the reason measured on
transformers 5.24.0 (docs/architectures.md): ``status()`` lists them, ``apply()``
never touches them, ``verify()`` still probes them."""

from ..declarations import NOT_COVERED, NOT_FIXABLE, Undeclared

RECURRENT = "a recurrent or convolution state absorbs pads: a hole in a cached prefix still advances it"
HYBRID = f"attention layers are fixed by positions, but {RECURRENT}"
ENCODER_AS_DECODER = "an encoder whose causal-LM head runs it as a decoder (is_decoder=True): not measured (BERT's is patched: bert)"
CACHE_COLUMNS = (
    "position_ids have no effect: a relative bias counts cache columns, and short convolutions see pads"
)

# fmt: off
UNDECLARED = (
    Undeclared("mamba", NOT_FIXABLE, f"SSM: {RECURRENT}"),
    Undeclared("mamba2", NOT_FIXABLE, f"SSM: {RECURRENT}"),
    Undeclared("falcon_mamba", NOT_FIXABLE, f"SSM: {RECURRENT}"),
    Undeclared("rwkv", NOT_FIXABLE, f"RWKV token shift and state: {RECURRENT}"),
    Undeclared("xlstm", NOT_FIXABLE, f"mLSTM: {RECURRENT}"),
    Undeclared("bailing_hybrid", NOT_FIXABLE, f"linear attention: {HYBRID}"),
    Undeclared("bamba", NOT_FIXABLE, f"Mamba2: {HYBRID}; its cached step is off even unpadded"),
    Undeclared("falcon_h1", NOT_FIXABLE, f"parallel Mamba2: {HYBRID}"),
    Undeclared("granitemoehybrid", NOT_FIXABLE, f"Mamba: {HYBRID}"),
    Undeclared("jamba", NOT_FIXABLE, f"Mamba: {HYBRID}"),
    Undeclared("kimi_linear", NOT_FIXABLE, f"KDA linear attention: {HYBRID}"),
    Undeclared("lara_mini", NOT_FIXABLE, f"linear attention: {HYBRID}"),
    Undeclared("lfm2", NOT_FIXABLE, f"short convolutions: {HYBRID}"),
    Undeclared("lfm2_moe", NOT_FIXABLE, f"short convolutions: {HYBRID}"),
    Undeclared("lfm3", NOT_FIXABLE, f"short convolutions: {HYBRID}"),
    Undeclared("nemotron_h", NOT_FIXABLE, f"Mamba2: {HYBRID}"),
    Undeclared("olmo_hybrid", NOT_FIXABLE, f"Gated DeltaNet: {HYBRID}"),
    Undeclared("qwen3_5", NOT_FIXABLE, f"Gated DeltaNet: {HYBRID}"),
    Undeclared("qwen3_5_text", NOT_FIXABLE, f"Gated DeltaNet: {HYBRID}"),
    Undeclared("qwen3_5_moe", NOT_FIXABLE, f"Gated DeltaNet: {HYBRID}"),
    Undeclared("qwen3_5_moe_text", NOT_FIXABLE, f"Gated DeltaNet: {HYBRID}"),
    Undeclared("qwen3_next", NOT_FIXABLE, f"Gated DeltaNet: {HYBRID}"),
    Undeclared("qwen4_exp", NOT_FIXABLE, f"Gated DeltaNet: {HYBRID}"),
    Undeclared("qwen4_exp_text", NOT_FIXABLE, f"Gated DeltaNet: {HYBRID}"),
    Undeclared("zamba", NOT_FIXABLE, f"Mamba: {HYBRID}"),
    Undeclared("zamba2", NOT_FIXABLE, f"Mamba2: {HYBRID}"),
    Undeclared("zaya", NOT_FIXABLE, f"convolutional (CCA) attention: {RECURRENT}"),
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
    Undeclared("xlm", NOT_COVERED, "XLM's causal mode (a masked LM's, with language embeddings): not measured"),
    Undeclared("xlnet", NOT_COVERED, "XLNet: a permutation LM whose positions are relative to its memory (mems): not measured"),
)
# fmt: on
