"""sentence-transformers, with its own encode/predict: a tiny GPT-2 as a SentenceTransformer with
last-token pooling, and a tiny GPT-Neo causal LM as a CrossEncoder (its automatic yes/no LogitScore
head), each saved to a folder with a word-level tokenizer built here, on left-padded batches. Each
sentence's embedding (each pair's score) in a batch against the same sentence alone: stock is wrong
(absolute positions move with left padding), hfpatch exact."""

from __future__ import annotations

import pytest
import torch

import hfpatch
from hfpatch.verification.tiny import tiny_model

from conftest import arch_skip_reason
from harness import TOLERANCE, WRONG

st = pytest.importorskip("sentence_transformers")
from sentence_transformers.base.modules import Transformer  # noqa: E402 (the new home of models.Transformer)
from sentence_transformers.sentence_transformer.modules import Pooling  # noqa: E402

WORDS = "the a cat dog sat on mat ran far away quick brown fox jumps over lazy red house tree river"
SENTENCES = ["the cat sat", "a quick brown fox jumps over the lazy dog", "red house", "the dog ran far away"]
PAIRS = [
    ("the cat sat", "on the mat"),
    ("a quick brown fox", "jumps over the lazy dog far away"),
    ("red", "tree"),
]


def _checkpoint(tmp_path, arch: str) -> str:
    """A tiny random model of ``arch`` and a word-level tokenizer (left padding), saved together."""
    reason = arch_skip_reason(arch)
    if reason:
        pytest.skip(reason)
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word: i for i, word in enumerate(["[PAD]", "[UNK]", "<s>", "</s>", "yes", "no", *WORDS.split()])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    folder = str(tmp_path / arch)
    tiny_model(arch).save_pretrained(folder)
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="[PAD]", unk_token="[UNK]", padding_side="left"
    ).save_pretrained(folder)
    return folder


def _errors(run, inputs) -> tuple[float, float]:
    """(stock, hfpatch): largest |difference| between each input's output in one padded batch and alone."""
    with hfpatch.unpatched():
        alone = torch.stack([run([x])[0] for x in inputs])
        stock = run(inputs)
    return (stock - alone).abs().max().item(), (run(inputs) - alone).abs().max().item()


def test_sentence_transformer_last_token_pooling(tmp_path):
    folder = _checkpoint(tmp_path, "gpt2")
    model = st.SentenceTransformer(
        modules=[Transformer(folder), Pooling(64, pooling_mode="lasttoken")], device="cpu"
    )
    assert model[0].tokenizer.padding_side == "left"

    def encode(sentences):
        return model.encode(sentences, batch_size=len(sentences), convert_to_tensor=True)

    stock, patched = _errors(encode, SENTENCES)
    assert stock > WRONG and patched <= TOLERANCE, (stock, patched)


def test_cross_encoder_with_a_causal_lm(tmp_path):
    model = st.CrossEncoder(_checkpoint(tmp_path, "gpt_neo"), device="cpu")  # *ForCausalLM: yes/no logits
    assert type(model[1]).__name__ == "LogitScore"

    def predict(pairs):
        return torch.as_tensor(model.predict(pairs, batch_size=len(pairs), activation_fn=torch.nn.Identity()))

    stock, patched = _errors(predict, PAIRS)
    assert stock > WRONG and patched <= TOLERANCE, (stock, patched)
