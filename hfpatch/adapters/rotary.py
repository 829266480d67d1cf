"""The rotary family: RoPE and its relatives take ``position_ids`` as offsets, so a uniform left-pad
shift cancels out, but the holes of a padded cached prefix do not. One line per patched class:
model type, class, family, the first release of its tested range (and, where they apply, its
package, aliases, limits, known-bad releases)."""

from ..declarations import Adapter, Family

# rope whose scaling depends on the length (a checkpoint's longrope or dynamic NTK) is scaled per row
# where transformers' dynamic_rope_update lets hfpatch reach it (hfpatch/rope.py)
PER_BATCH_ROPE = (
    ("<4.51", "a checkpoint's longrope or dynamic NTK rope is scaled by the batch's longest row here"),
    (">=4.51,<4.56", "a checkpoint's dynamic NTK rope is scaled by the batch's longest row here"),
)
ROTARY = Family(
    "rotary",
    attached_cache="layers.0.self_attn.past_key_value",
    notes=PER_BATCH_ROPE,
)

SDPA_436 = (">=4.36,<4.38", "_use_sdpa")  # transformers' _unmask_unattended: see Adapter.eager_mask
# known-bad releases inside a range (never patched there), each measured by the compat probe
MASK_437 = (
    "a left-padded cached prefix continued by several tokens stays wrong with the right positions (the "
    "release's own mask for such calls, eager attention too): use 4.39+"
)
HYBRID_CACHE = (
    "the cache the model creates for a call without one (a HybridCache sized to that call) cannot take more "
    "tokens: a continued call fails on stock too; use 4.53+"
)
COLUMN_WINDOW_BAD = (
    "{} decides its sliding window by cache column: past the window, a hole from a padded cached prefix stays "
    "wrong with the right positions ({} off with hfpatch on a tiny model), so it is not patched"
)
OLD_MASK = "transformers' 4-D mask of these releases"  # _prepare_4d_causal_attention_mask(sliding_window=...)
NOT_VERIFIED = "hfpatch's tiny {} model {} on these releases: no evidence either way"
COLUMN_WINDOW = (
    "sliding window: {} decides it by cache column, so a hole from a padded cached prefix inside the "
    "window stays wrong (hfpatch makes the window positional for full, sliding and chunked layers only)"
)
RECURRENT_GEMMA_4X = (
    "before 5.4 its attention keeps its keys on itself and its recurrent blocks their state: a padded batch in "
    "one call is fixed (its recurrence restarts where position_ids are 0), a padded prefix continued later "
    "is not, and packed rows are not kept; from 5.4 its recurrent blocks run each sequence alone"
)
LINEAR_LAYERS = "no: its linear-attention layers carry their state from one packed sequence into the next"
COMPRESSED_LAYERS = "no: its compressed attention layers take no mask by sequence"
BY_LANGUAGE_MODEL = "yes: its language model keeps them (the multimodal model passes the positions on)"
LLAMA4_NOPE = (
    "NoPE layers with attention temperature tuning (floor_scale) read positions from the cache length, "
    "not position_ids: left padding stays slightly wrong there (9e-3 on a tiny model)"
)

# fmt: off
ADAPTERS = (
    Adapter("afmoe", "AfmoeModel", ROTARY, "5.0"),
    Adapter("apertus", "ApertusModel", ROTARY, "4.56"),
    Adapter("apertus1p5_text", "Apertus1p5TextModel", ROTARY, "5.24", package="apertus1p5"),
    Adapter("arcee", "ArceeModel", ROTARY, "4.53"),
    Adapter("aria_text", "AriaTextModel", ROTARY, "4.48", package="aria"),
    Adapter("axk1", "AXK1Model", ROTARY, "5.15"),
    Adapter("axk2", "AXK2Model", ROTARY, "5.15"),
    Adapter("beam", "BeamModel", ROTARY, "5.20"),
    Adapter("bitnet", "BitNetModel", ROTARY, "4.52"),
    Adapter("codegen", "CodeGenModel", ROTARY, "4.28"),
    Adapter("cohere", "CohereModel", ROTARY, "4.39"),
    Adapter("cohere2", "Cohere2Model", ROTARY, "4.53"),
    Adapter("cohere2_moe", "Cohere2MoeModel", ROTARY, "5.9"),
    Adapter("cohere_compass_text", "CohereCompassTextModel", ROTARY, "5.16", package="cohere_compass", unverified=((">=5.17,<5.21", NOT_VERIFIED.format("Cohere Compass", "cannot be built")),)),
    Adapter("cwm", "CwmModel", ROTARY, "5.0"),
    Adapter("dbrx", "DbrxModel", ROTARY, "4.40", unverified=((">=5.0,<5.15", NOT_VERIFIED.format("DBRX", "fails a plain forward call")),)),
    Adapter("deepseek_v2", "DeepseekV2Model", ROTARY, "4.54"),
    Adapter("deepseek_v3", "DeepseekV3Model", ROTARY, "4.51", aliases=("sarvam_mla",)),
    Adapter("deepseek_v32", "DeepseekV32Model", ROTARY, "5.11"),
    Adapter("deepseek_v4", "DeepseekV4Model", ROTARY, "5.8", known_bad=((">=5.14", COLUMN_WINDOW_BAD.format("its compressed attention", "0.55")),), packed=COMPRESSED_LAYERS),
    Adapter("diffllama", "DiffLlamaModel", ROTARY, "4.48"),
    Adapter("doge", "DogeModel", ROTARY, "5.18"),
    Adapter("dory", "DoryModel", ROTARY, "5.24"),
    Adapter("ergo", "ErgoModel", ROTARY, "5.25"),
    Adapter("dots1", "Dots1Model", ROTARY, "4.53"),
    Adapter("dots3_note_text", "Dots3NoteTextModel", ROTARY, "5.23", package="dots3_note", aliases=("dots3_note",)),
    Adapter("emu3", "Emu3TextModel", ROTARY, "5.8"),
    Adapter("ernie4_5", "Ernie4_5Model", ROTARY, "4.54"),
    Adapter("ernie4_5_moe", "Ernie4_5_MoeModel", ROTARY, "4.54"),
    Adapter("exaone4", "Exaone4Model", ROTARY, "4.54"),
    Adapter("exaone_moe", "ExaoneMoeModel", ROTARY, "5.1"),
    Adapter("falcon", "FalconModel", ROTARY, "4.34", eager_mask=SDPA_436, known_bad=((">=4.38,<4.39", MASK_437),)),
    Adapter("flex_olmo", "FlexOlmoModel", ROTARY, "4.57"),
    Adapter("flint", "FlintModel", ROTARY, "5.21"),
    Adapter("gemma", "GemmaModel", ROTARY, "4.38"),
    Adapter("gemma2", "Gemma2Model", ROTARY, "4.42", known_bad=((">=4.45,<4.53", HYBRID_CACHE),)),
    Adapter("gemma3_text", "Gemma3TextModel", ROTARY, "4.53", package="gemma3"),
    Adapter("gemma3", "Gemma3Model", ROTARY, "4.53"),  # multimodal: builds a dict of masks for the text model
    Adapter("gemma3n_text", "Gemma3nTextModel", ROTARY, "4.56", package="gemma3n"),
    Adapter("gemma4_text", "Gemma4TextModel", ROTARY, "5.5", package="gemma4"),
    Adapter("gemma4", "Gemma4Model", ROTARY, "5.5", limits=(COLUMN_WINDOW.format("the multimodal model's text model"),)),  # multimodal: counts positions itself
    Adapter("gemma4_unified_text", "Gemma4UnifiedTextModel", ROTARY, "5.10", package="gemma4_unified"),
    Adapter("gemma4_unified", "Gemma4UnifiedModel", ROTARY, "5.10", limits=(COLUMN_WINDOW.format("the multimodal model's text model"),)),
    Adapter("glm", "GlmModel", ROTARY, "4.46"),
    Adapter("glm4", "Glm4Model", ROTARY, "4.51"),
    Adapter("glm4_moe", "Glm4MoeModel", ROTARY, "4.54", aliases=("sarvam_moe", "param2moe"), alias_since=(("param2moe", "5.25"),)),
    Adapter("glm4_moe_lite", "Glm4MoeLiteModel", ROTARY, "5.15"),
    Adapter("glm_moe_dsa", "GlmMoeDsaModel", ROTARY, "5.11"),
    Adapter("gpt_neox", "GPTNeoXModel", ROTARY, "4.28"),
    Adapter("gpt_neox_japanese", "GPTNeoXJapaneseModel", ROTARY, "4.45"),
    Adapter("gpt_oss", "GptOssModel", ROTARY, "4.55"),
    Adapter("gptj", "GPTJModel", ROTARY, "4.28"),
    Adapter("granite", "GraniteModel", ROTARY, "4.45"),
    Adapter("granite_swa", "GraniteSWAModel", ROTARY, "5.15"),
    Adapter("granitemoe", "GraniteMoeModel", ROTARY, "4.45"),
    Adapter("granitemoe_swa", "GraniteMoeSWAModel", ROTARY, "5.15"),
    Adapter("granitemoeshared", "GraniteMoeSharedModel", ROTARY, "4.49"),
    Adapter("helium", "HeliumModel", ROTARY, "4.49"),
    Adapter("hrm_text", "HrmTextModel", ROTARY, "5.9"),
    Adapter("hunyuan_v1_dense", "HunYuanDenseV1Model", ROTARY, "4.56"),
    Adapter("hunyuan_v1_moe", "HunYuanMoEV1Model", ROTARY, "4.56"),
    Adapter("hy_v3", "HYV3Model", ROTARY, "5.6"),
    Adapter("hy_v4", "HYV4Model", ROTARY, "5.17"),
    Adapter("hyperclovax", "HyperCLOVAXModel", ROTARY, "5.9"),
    Adapter("jais2", "Jais2Model", ROTARY, "5.0"),
    Adapter("jetmoe", "JetMoeModel", ROTARY, "4.41", unverified=((">=4.48,<5.0", NOT_VERIFIED.format("JetMoE", "fails a plain forward call")),)),
    Adapter("kolibri1", "Kolibri1Model", ROTARY, "5.20"),
    Adapter("laguna", "LagunaModel", ROTARY, "5.7"),
    Adapter("llama", "LlamaModel", ROTARY, "4.28", aliases=("exaone", "internlm3", "iquestcoder"), eager_mask=SDPA_436),
    Adapter("llama4_text", "Llama4TextModel", ROTARY, "4.52", package="llama4", aliases=("llama4",), alias_since=(("llama4", "5.8"),), limits=(LLAMA4_NOPE,), unverified=((">=4.54,<4.56", NOT_VERIFIED.format("Llama 4 text", "is not causal (a token's output depends on later tokens)")),)),
    Adapter("longcat_flash", "LongcatFlashModel", ROTARY, "5.13"),
    Adapter("mellum", "MellumModel", ROTARY, "5.10"),
    Adapter("mimo_v2_flash", "MiMoV2FlashModel", ROTARY, "5.13"),
    Adapter("minicpm3", "MiniCPM3Model", ROTARY, "5.13"),
    Adapter("minicpm5_moe", "MiniCPM5MoeModel", ROTARY, "5.25"),
    Adapter("kolibri1_1", "Kolibri1_1Model", ROTARY, "5.25"),
    Adapter("minimax_m2", "MiniMaxM2Model", ROTARY, "5.0"),
    Adapter("minimax_m3_vl_text", "MiniMaxM3VLTextModel", ROTARY, "5.12", package="minimax_m3_vl"),
    Adapter("ministral", "MinistralModel", ROTARY, "4.57"),
    Adapter("ministral3", "Ministral3Model", ROTARY, "5.0"),
    Adapter("mistral", "MistralModel", ROTARY, "4.34", known_bad=((">=4.34,<4.37", COLUMN_WINDOW_BAD.format(OLD_MASK, "0.45-0.50")), (">=4.37,<4.39", MASK_437), (">=4.40,<4.42", COLUMN_WINDOW_BAD.format(OLD_MASK, "0.40")))),
    Adapter("mixtral", "MixtralModel", ROTARY, "4.36", known_bad=((">=4.36,<4.37", COLUMN_WINDOW_BAD.format(OLD_MASK, "0.80")), (">=4.37,<4.39", MASK_437))),
    Adapter("mllama", "MllamaTextModel", ROTARY, "5.0"),
    Adapter("modernbert-decoder", "ModernBertDecoderModel", ROTARY, "4.54"),
    Adapter("moshi", "MoshiModel", ROTARY, "5.18", known_bad=((">=5.18", COLUMN_WINDOW_BAD.format("its sliding cache (dropping keys)", "0.94")),)),
    Adapter("nanochat", "NanoChatModel", ROTARY, "5.0"),
    Adapter("nemotron", "NemotronModel", ROTARY, "4.44"),
    Adapter("olmo", "OlmoModel", ROTARY, "4.40"),
    Adapter("olmo2", "Olmo2Model", ROTARY, "4.47"),
    Adapter("olmo3", "Olmo3Model", ROTARY, "4.57"),
    Adapter("olmoe", "OlmoeModel", ROTARY, "4.45"),
    Adapter("persimmon", "PersimmonModel", ROTARY, "4.34"),
    Adapter("recurrent_gemma", "RecurrentGemmaModel", ROTARY, "4.40", limits=(RECURRENT_GEMMA_4X,), steps=">=4.0"),  # its recurrent blocks: hfpatch.mixers (5.4+)
    Adapter("fuyu", "FuyuModel", ROTARY, "4.52", packed=BY_LANGUAGE_MODEL),  # multimodal: counts positions itself
    Adapter("phi", "PhiModel", ROTARY, "4.36"),
    Adapter("phi3", "Phi3Model", ROTARY, "4.41"),
    Adapter("phi4_multimodal", "Phi4MultimodalModel", ROTARY, "5.1"),
    Adapter("phimoe", "PhimoeModel", ROTARY, "4.46"),
    Adapter("qwen2", "Qwen2Model", ROTARY, "4.39", aliases=("got_ocr2",), known_bad=((">=4.40,<4.42", COLUMN_WINDOW_BAD.format(OLD_MASK, "0.58")),)),
    Adapter("qwen2_moe", "Qwen2MoeModel", ROTARY, "4.40", known_bad=((">=4.40,<4.42", COLUMN_WINDOW_BAD.format(OLD_MASK, "0.43")),)),
    Adapter("qwen3", "Qwen3Model", ROTARY, "4.51", aliases=("moss_transcribe_diarize",)),
    Adapter("qwen3_moe", "Qwen3MoeModel", ROTARY, "4.51"),
    Adapter("seed_oss", "SeedOssModel", ROTARY, "4.56"),
    Adapter("smollm3", "SmolLM3Model", ROTARY, "4.53"),
    Adapter("solar_open", "SolarOpenModel", ROTARY, "5.0"),
    Adapter("stablelm", "StableLmModel", ROTARY, "4.38"),
    Adapter("starcoder2", "Starcoder2Model", ROTARY, "4.39"),
    Adapter("vaultgemma", "VaultGemmaModel", ROTARY, "4.57"),
    Adapter("youtu", "YoutuModel", ROTARY, "5.1"),
)
# fmt: on
