"""The decoders (and encoders) of encoder-decoder models: text-to-text, speech-to-text.

Their forward is called by the seq2seq model with ``attention_mask=decoder_attention_mask`` (past + new
tokens, as a decoder-only model's mask), so positions come from it the same way. Four families, by
where the positions go (:mod:`hfpatch.decoders`):

- the forward takes ``position_ids`` (Whisper, T5Gemma, Canary, Moonshine ...): the seq2seq model
  passes ``decoder_position_ids`` through, ``None`` unless the caller gave them; the patched decoder
  derives them, as for a decoder-only base model;
- a position table (the BART family): handed to the decoder's ``embed_positions``, and the encoder's
  (whose absolute positions are wrong under left padding on stock too);
- a table that starts past the pad id (M2M100, NLLB-MoE, SeamlessM4T, Speech2Text): left padding is
  right on stock when pads carry the pad id, a padded cached prefix is not; decoder only;
- T5's relative bias: computed per row from positions, in every stack (encoder and decoder share the
  class; a uniform left shift cancels in the encoder, and stays exact).

Each row: model type, the class patched, family, first release of its range, the receiver class, the
encoder classes. Each range starts at the first release where the release probe (compat/probe_matrix.sh:
tests/test_decoders.py and ``hfpatch.verify`` on all 64 releases, compat/REPORT.md) finds the type exact.
"""

from ..declarations import PADDED_TABLE, RELATIVE_BIAS, SINUSOID, TABLE, Adapter, Family
from .rotary import MASK_437

POSITION_IDS_ABSOLUTE = Family("absolute decoder", seq2seq=True)
POSITION_IDS_ROTARY = Family("rotary decoder", seq2seq=True)
# RoPE, but self and cross attention merged in one softmax: rotated queries meet un-rotated encoder keys,
# so a query's absolute position matters and left padding is wrong on stock too (T5Gemma 2)
POSITION_IDS_MERGED = Family("rotary decoder, merged attention", seq2seq=True)
# RoPE, decoder inputs of audio codes [batch, tokens, channels] (Dia)
POSITION_IDS_CODES = Family("rotary decoder, audio codes", seq2seq=True, ids_rank=3)
POSITION_TABLE = Family(
    "position table",
    hands_to=TABLE,
    position_module="embed_positions",
    seq2seq=True,
)
POSITION_SINUSOID = Family(
    "computed sinusoid", hands_to=SINUSOID, position_module="embed_positions",
    seq2seq=True,
)  # fmt: skip
PADDED_POSITION_TABLE = Family(
    "table past the pad id", hands_to=PADDED_TABLE,
    position_module="embed_positions", seq2seq=True,
)  # fmt: skip
RELATIVE_POSITION_BIAS = Family("relative bias", hands_to=RELATIVE_BIAS, seq2seq=True)


def _bart_like(arch: str, prefix: str, since: str, table: str = "LearnedPositionalEmbedding") -> Adapter:
    return Adapter(
        arch,
        f"{prefix}Decoder",
        POSITION_TABLE,
        since,
        receiver=f"{prefix}{table}",
        also=(f"{prefix}Encoder",),
    )


def _padded(arch: str, prefix: str, since: str) -> Adapter:
    return Adapter(
        arch,
        f"{prefix}Decoder",
        PADDED_POSITION_TABLE,
        since,
        receiver=f"{prefix}SinusoidalPositionalEmbedding",
    )


def _t5_like(arch: str, prefix: str, since: str) -> Adapter:
    return Adapter(arch, f"{prefix}Stack", RELATIVE_POSITION_BIAS, since, receiver=f"{prefix}Attention")


# fmt: off
ADAPTERS = (
    _bart_like("bart", "Bart", since="4.20")._replace(known_bad=((">=4.36,<4.39", MASK_437),)),
    _bart_like("mbart", "MBart", since="4.20"),
    _bart_like("plbart", "PLBart", since="4.20"),
    _bart_like("mvp", "Mvp", since="4.21"),
    _bart_like("blenderbot", "Blenderbot", since="4.20"),
    _bart_like("blenderbot-small", "BlenderbotSmall", since="4.20"),
    _bart_like("bigbird_pegasus", "BigBirdPegasus", since="4.52"),
    _bart_like("marian", "Marian", since="4.20", table="SinusoidalPositionalEmbedding"),
    _bart_like("pegasus", "Pegasus", since="4.20", table="SinusoidalPositionalEmbedding"),
    Adapter("pegasus_x", "PegasusXDecoder", POSITION_SINUSOID, "4.52", receiver="PegasusXSinusoidalPositionalEmbedding", also=("PegasusXEncoder",)),
    _padded("m2m_100", "M2M100", since="4.35"),
    _padded("nllb-moe", "NllbMoe", since="4.35"),
    _padded("seamless_m4t", "SeamlessM4T", since="4.35"),
    _padded("seamless_m4t_v2", "SeamlessM4Tv2", since="4.36"),
    Adapter("speech_to_text", "Speech2TextDecoder", PADDED_POSITION_TABLE, "4.20", receiver="Speech2TextSinusoidalPositionalEmbedding"),
    # the decoder takes hidden states: its text prenet (ids, the decoder's mask and cache) holds the table
    Adapter("speecht5", "SpeechT5TextDecoderPrenet", PADDED_POSITION_TABLE, "4.27", receiver="SpeechT5SinusoidalPositionalEmbedding"),
    _t5_like("t5", "T5", since="4.46"),
    _t5_like("mt5", "MT5", since="4.46"),
    _t5_like("umt5", "UMT5", since="4.46")._replace(known_bad=((">=5.15,<5.18", "UMT5 with SDPA attention (new in 5.15) is wrong on stock with any padded decoder mask, positions aside (right padding in one call, unpadded rows too): use 5.18+"),)),
    _t5_like("longt5", "LongT5", since="4.46"),
    _t5_like("switch_transformers", "SwitchTransformers", since="4.46"),
    _t5_like("pop2piano", "Pop2Piano", since="4.46"),
    Adapter("whisper", "WhisperDecoder", POSITION_IDS_ABSOLUTE, "4.39"),
    Adapter("t5gemma", "T5GemmaDecoder", POSITION_IDS_ROTARY, "4.53"),
    Adapter("t5gemma2", "T5Gemma2Decoder", POSITION_IDS_MERGED, "5.0", known_bad=((">=5.4,<5.15", "its decoder cannot take masks decided by position (5.4-5.14 read a name only its own mask code defines), so its sliding window counts cache columns: a padded cached prefix continued past the window is 0.62 off with the right positions; use 5.15+"),)),
    Adapter("canary", "CanaryDecoder", POSITION_IDS_ABSOLUTE, "5.17"),
    Adapter("cohere_asr", "CohereAsrDecoder", POSITION_IDS_ABSOLUTE, "5.13"),
    Adapter("moonshine", "MoonshineDecoder", POSITION_IDS_ROTARY, "4.48"),
    Adapter("dia", "DiaDecoder", POSITION_IDS_CODES, "4.53"),
    Adapter("moonshine_streaming", "MoonshineStreamingDecoder", POSITION_IDS_ROTARY, "5.2"),
)
# fmt: on
