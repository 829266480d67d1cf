"""The absolute family: learned or fixed position tables (GPT-2's ``wpe``, sinusoids), so left padding
and padded cached prefixes both shift every real token's embedding. Positions from the mask fix both."""

from ..declarations import Adapter, Family

ABSOLUTE = Family("absolute")

# fmt: off
ADAPTERS = (
    # BERT as a decoder (is_decoder=True: the decoder of an encoder-decoder model, or a causal LM alone): its
    # LM-head class, so that BertModel as an encoder is left alone
    Adapter("bert", "BertLMHeadModel", ABSOLUTE, "4.20", known_bad=((">=4.54,<5.0", "BERT with SDPA attention and a StaticCache fails on stock (a mask of the wrong length), so the release is not verified: use 5.0+"),)),
    Adapter("biogpt", "BioGptModel", ABSOLUTE, "4.52"),  # before, no position_ids (its table reads the mask)
    Adapter("ctrl", "CTRLModel", ABSOLUTE, "4.20"),
    Adapter("gpt2", "GPT2Model", ABSOLUTE, "4.20", aliases=("gpt-sw3",)),
    Adapter("gpt_bigcode", "GPTBigCodeModel", ABSOLUTE, "4.28", known_bad=((">=4.36,<4.39", "a left-padded cached prefix continued by several tokens stays wrong with the right positions (stock is right on the others here): use 4.39+"),)),
    Adapter("gpt_neo", "GPTNeoModel", ABSOLUTE, "4.20"),
    Adapter("openai-gpt", "OpenAIGPTModel", ABSOLUTE, "4.20", package="openai"),
    Adapter("xglm", "XGLMModel", ABSOLUTE, "4.29"),
)
# fmt: on
