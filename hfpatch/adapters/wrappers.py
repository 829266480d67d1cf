"""The image-text-to-text wrappers hfpatch patches itself (:data:`ADAPTERS`), then the model types of
transformers' seq2seq, speech-seq2seq and image-text-to-text mappings that no adapter patches
(hfpatch/adapters/seq2seq.py patches the seq2seq decoders), each with its verdict, measured on 5.24.0
with tiny models (``hfpatch verify TYPE`` on each), or "not measured" with what is known.

Patched (family ``rotary`` with ``multimodal=True``: no causal LM of their own: ``verify()`` runs their
text calls (no image), the release probe leaves them to tests/test_wrappers.py; windows stay
transformers'):

- the wrapper's own forward, where it counts ``arange(past, past + new)`` itself and hands it to its
  text model (PaliGemma, EXAONE 4.5): positions from the mask, 1-D as the wrapper's own;
- the text model, where the wrapper hands it ``position_ids=None`` in a text-only call (the Qwen-VL
  family: multimodal rope positions come from the mask only after an image prefill set ``rope_deltas``):
  1-D positions from the mask, which the text model broadcasts to its rope sections as it does its own
  ``arange``; the 3-D positions of an image call are the wrapper's, forwarded unchanged;
- Chameleon and Granite-Docling, whose text models count ``arange`` like any decoder.

Each from the first release where the probe (tests/test_wrappers.py on every release, compat/REPORT.md)
finds it exact. The Qwen-VL family from its text model's first release (Qwen2-VL and Qwen2.5-VL 4.52,
GLM-4V 4.53, Qwen3-VL 4.57): where its wrapper derives text-only positions itself (``get_rope_index``, then
``rope_deltas`` in cached calls; wrong for a padded cached prefix before 5.0 and after 5.1, right on
5.0-5.1), or hands the text model none, :mod:`hfpatch.deltas` numbers a cached call without positions by
real tokens, keeping each row's rope deltas; an image prefill continued by plain calls too, and a packed
row with images given 2-D positions gets each sequence's own multimodal rope positions. ``generate()``
passes positions of its own. PaliGemma is a prefix LM: on 4.57.6 and 5.5.4 a masked prefill attends the
whole prompt both ways, so its reference is each row alone through the same cached calls.

Packed rows (positions restarting, text only): the text models keep them as a decoder does, from the
2-D positions a collator gives or the multimodal rope forms (``[text; t; h; w]`` by its text row,
``[t; h; w]`` restarting where all three are 0; :func:`hfpatch.positions.segments`); a wrapper that hands
the positions to a patched language model (EXAONE 4.5) keeps them there; PaliGemma, a prefix LM, does not.

Not patched:

- ``through its language model``: a wrapper whose language model is a class hfpatch patches (LLaVA runs
  ``LlamaModel``): fixed, measured (a right-padded prefix continued from the cache, text only);
- ``not fixable by positions``: measured wrong with the right positions too;
- ``not covered``: positions would fix it (by hand), or it was not measured (the reason says which).
"""

from ..declarations import NOT_COVERED, NOT_FIXABLE, THROUGH_LANGUAGE_MODEL, Adapter, Undeclared
from .rotary import BY_LANGUAGE_MODEL, ROTARY

MULTIMODAL = ROTARY._replace(multimodal=True)
WINDOW = (
    "sliding window: decided by cache column (transformers', which builds it from the wrapper's mask), so a "
    "hole from a padded cached prefix inside the window stays wrong; prefixes shorter than the window are exact"
)
PREFIX_LM = "no: a prefix LM (a call's text attends both ways): no packed row is its sequences alone"
PALIGEMMA_SDPA = (
    "sdpa", ">=5.9",
    "a padded text prefix stays wrong with the right positions, on stock alike (its prefix attends both ways; "
    "measured 5.9.0-5.24.0): eager attention is exact",
)  # fmt: skip

# fmt: off
ADAPTERS = (
    Adapter("paligemma", "PaliGemmaModel", MULTIMODAL, "4.52", limits=(WINDOW,), wrong_with=(PALIGEMMA_SDPA,), packed=PREFIX_LM),  # 2: Gemma 2's window
    Adapter("exaone4_5", "Exaone4_5_Model", MULTIMODAL, "5.8", limits=(WINDOW,), packed=BY_LANGUAGE_MODEL),
    Adapter("qwen2_vl", "Qwen2VLTextModel", MULTIMODAL, "4.52"),
    Adapter("qwen2_5_vl", "Qwen2_5_VLTextModel", MULTIMODAL, "4.52"),
    Adapter("qwen3_vl", "Qwen3VLTextModel", MULTIMODAL, "4.57"),
    Adapter("qwen3_vl_moe", "Qwen3VLMoeTextModel", MULTIMODAL, "4.57"),
    Adapter("glm4v", "Glm4vTextModel", MULTIMODAL, "4.53", aliases=("glm46v", "glmga"), alias_since=(("glm46v", "5.2"), ("glmga", "5.24"))),
    Adapter("paddleocr_vl", "PaddleOCRTextModel", MULTIMODAL, "5.0"),
    Adapter("hunyuan_vl", "HunYuanVLTextModel", MULTIMODAL, "5.13"),
    Adapter("chameleon", "ChameleonModel", MULTIMODAL, "4.49"),
    Adapter("granite_docling", "GraniteDoclingTextModel", MULTIMODAL, "5.23"),
)
# fmt: on

MEASURED = "measured fixed on 5.24.0 (text only; the image/audio path not measured)"
WITH_IMAGE = (
    "measured fixed on 4.57.6, 5.5.4 and 5.24.0, text only and with an image in a padded cached batch"
)
WITH_AUDIO = (
    "measured fixed on 4.57.6, 5.5.4 and 5.24.0 with audio (each row its own audio and text, right-padded, "
    "continued from the cache by one token: stock 0.17-0.34, hfpatch exact; tests/test_wrappers.py)"
)
SEQ2SEQ_WRAPPER = (
    "runs the decoder of its decoder config: a patched decoder-only class (GPT-2 ...), or BERT as a decoder "
    "(BertLMHeadModel, patched by the 'bert' adapter): measured fixed on 5.24.0 (hfpatch verify); its encoder "
    "is not patched: a BERT encoder's positions are wrong for left-padded encoder inputs (pad on the right)"
)
NOT_MEASURED = "not measured ({})"


def _through(arch: str, adapter: str, cls: str, measured: str = MEASURED) -> Undeclared:
    return Undeclared(
        arch, THROUGH_LANGUAGE_MODEL, f"runs {cls}, patched by the {adapter!r} adapter; {measured}", adapter
    )


def _unmeasured(arch: str, why: str) -> Undeclared:
    return Undeclared(arch, NOT_COVERED, NOT_MEASURED.format(why))


def _language_model(arch: str, adapter: str) -> Undeclared:
    """A wrapper not measured whose default language model is a patched class."""
    return _unmeasured(
        arch, f"its default language model is patched by the {adapter!r} adapter; the wrapper is not checked"
    )


# fmt: off
UNDECLARED = (
    # seq2seq and speech-seq2seq
    _through("audioflamingo3", "qwen2", "Qwen2Model"),
    _through("glmasr", "llama", "LlamaModel"),
    _through("granite_speech", "granite", "GraniteModel"),
    _through("granite_speech_plus", "granite", "GraniteModel"),
    _through("musicflamingo", "qwen2", "Qwen2Model"),
    _through("omniasr", "llama", "LlamaModel"),
    _through("qwen2_audio", "qwen2", "Qwen2Model", WITH_AUDIO),
    _through("qwen3_asr", "qwen3", "Qwen3Model"),
    _through("voxtral", "llama", "LlamaModel"),
    _through("fun_asr_nano", "qwen3", "Qwen3Model"),
    Undeclared("encoder-decoder", THROUGH_LANGUAGE_MODEL, SEQ2SEQ_WRAPPER),
    Undeclared("speech-encoder-decoder", THROUGH_LANGUAGE_MODEL, SEQ2SEQ_WRAPPER),
    Undeclared("led", NOT_FIXABLE, "LEDDecoder builds its causal mask only for more than one new token: a 1-token step attends a cached pad whatever the positions (a left-padded prompt in one call would be fixed)"),
    Undeclared("fsmt", NOT_FIXABLE, "not self-consistent on 5.24 (right padding in one call, and each row alone through the cache, are off already): positions cannot be assessed"),
    Undeclared("prophetnet", NOT_FIXABLE, "n-gram stream decoder: right padding in one call and each row alone through the cache are off already; its position module returns a tuple"),
    Undeclared("xlm-prophetnet", NOT_FIXABLE, "ProphetNet's n-gram stream decoder (see prophetnet)"),
    _language_model("nemo_speechlm", "nemotron_h"),
    _unmeasured("vibevoice_asr", "its tiny model is too big to build"),
    _unmeasured("vibevoice", "its tiny model is too big to build"),
    _unmeasured("voxtral_realtime", "needs encoder inputs the probe did not build"),
    _unmeasured("kyutai_speech_to_text", "its tiny model fails a plain call"),
    _unmeasured("gptsan-japanese", "removed in 5.0"),
    Undeclared("speech_to_text_2", NOT_COVERED, "Speech2Text2's decoder (of a speech encoder-decoder model): not measured; mapped up to 4.57"),
    Undeclared("nllb", NOT_COVERED, "no model is of this type (NLLB checkpoints are m2m_100, patched by the 'm2m_100' adapter): an entry of the seq2seq mapping of 4.21-4.25 only"),
    # image-text-to-text: measured on 5.24.0 (hfpatch verify TYPE)
    _through("llava", "llama", "LlamaModel", WITH_IMAGE),
    _through("llava_next", "llama", "LlamaModel"),
    _through("llava_next_video", "llama", "LlamaModel"),
    _through("llava_onevision", "qwen2", "Qwen2Model"),
    _through("video_llava", "llama", "LlamaModel"),
    _through("vipllava", "llama", "LlamaModel"),
    _through("idefics2", "mistral", "MistralModel"),
    _through("idefics3", "llama", "LlamaModel"),
    _through("smolvlm", "llama", "LlamaModel"),
    _through("mistral3", "mistral", "MistralModel"),
    _through("aya_vision", "cohere2", "Cohere2Model"),
    _through("cohere2_vision", "cohere2", "Cohere2Model"),
    _through("internvl", "qwen2", "Qwen2Model"),
    _through("ovis2", "qwen2", "Qwen2Model"),
    _through("janus", "llama", "LlamaModel"),
    _through("deepseek_vl", "llama", "LlamaModel"),
    _through("lighton_ocr", "qwen3", "Qwen3Model"),
    _through("shieldgemma2", "gemma3", "Gemma3Model"),
    _language_model("lfm2_vl", "lfm2"),
    _language_model("lfm3_vl", "lfm3"),
    _unmeasured("qwen2_5_omni_thinker", "a cached call fails with its tiny config"),
    _unmeasured("perception_lm", "its vision tower needs timm and PIL; its default language model is patched by the 'llama' adapter"),
    _unmeasured("fast_vlm", "its vision tower needs timm and PIL; its default language model is patched by the 'qwen2' adapter"),
    _unmeasured("blip-2", "needs image inputs; its default language model, OPT, is right on stock with padding (its packed rows: the 'opt' adapter)"),
    _unmeasured("instructblip", "needs image inputs; its default language model, OPT, is right on stock with padding (its packed rows: the 'opt' adapter)"),
    _unmeasured("instructblipvideo", "needs video inputs; its default language model, OPT, is right on stock with padding (its packed rows: the 'opt' adapter)"),
    _unmeasured("kosmos-2", "needs image inputs"),
    _unmeasured("apertus1p5", "its tiny model is too big to build; its text model is patched by the 'apertus1p5_text' adapter"),
    # image-text-to-text: not measured
    _language_model("aria", "aria_text"),
    _language_model("cohere_compass", "cohere_compass_text"),
    _language_model("deepseek_vl_hybrid", "llama"),
    _language_model("hyperclovax_vision_v2", "hyperclovax"),
    _language_model("kimi_k25", "deepseek_v3"),
    _language_model("minimax_m3_vl", "minimax_m3_vl_text"),
    _language_model("pp_chart2table", "qwen2"),
    _language_model("qianfan_ocr", "qwen3"),
    _language_model("video_llama_3", "qwen2"),
    _language_model("florence2", "bart"),
    _language_model("pixtral", "mistral"),
    _language_model("ovis2_5", "qwen3"),
    _unmeasured("llava_onevision1_5", "its wrapper hands its language model arange positions of its own, not the mask's: left padding stays wrong there"),
    _unmeasured("pi05", "a robot policy that derives its positions from the mask itself"),
    _unmeasured("minicpm_ocr", "its language model is Qwen3.5: Gated DeltaNet layers absorb pads"),
    _unmeasured("minicpmv4_6", "its language model is Qwen3.5: Gated DeltaNet layers absorb pads"),
    _unmeasured("minicpmv4_7", "its language model is Qwen3.5: Gated DeltaNet layers absorb pads"),
    _language_model("nemotron_h_omni", "nemotron_h"),
    _unmeasured("inkling2", "its text model is not fixable by positions (inkling2_text)"),
    _unmeasured("inkling2_loop", "its text model is not fixable by positions (inkling2_loop_text)"),
    _unmeasured("inkling_mm_model", "its text model is not fixable by positions (inkling_text)"),
    _unmeasured("udop", "a T5-style encoder-decoder with layout inputs; UdopStack is not declared"),
    _unmeasured("vision-encoder-decoder", "runs the decoder of its decoder config (see encoder-decoder)"),
    *(
        _unmeasured(arch, "its text model is not declared")
        for arch in (
            "blip", "cosmos3_edge", "cosmos3_omni", "deepseek_ocr2", "diffusion_gemma", "ernie4_5_vl_moe",
            "evolla", "glm4v_moe", "glm5_next", "glm_ocr", "granite4_vision", "hy_v4_vl", "idefics",
            "kosmos-2.5", "mistral4", "mistral_large4", "molmo2", "muse_glimmer", "muse_spark", "pi0",
            "pix2struct", "pp_formulanet", "qwen3_omni_moe_thinker", "step3p7", "unlimited_ocr",
        )
    ),
)
# fmt: on
