"""Incremental detokenization with the real SmolLM2 tokenizer."""

import random

import pytest

from rosecli.engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tok(cache_dir):
    from rosecli.engine.config import EngineConfig
    from rosecli.engine.loader import dummy_tokenizer

    return dummy_tokenizer(EngineConfig(cache_dir=cache_dir))


@pytest.mark.parametrize("text", ["你好，世界", "👋🏽🎉 party", "café naïve Ünïcödé", "mixed 日本語 and emoji 🚀!"])
def test_multibyte_characters_split_across_tokens(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tok.decode([i]) for i in ids), "the text should contain a character split over tokens"
    d = IncrementalDetokenizer(tok)
    pieces = [d.push(i) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + d.flush() == text


def test_concatenation_equals_full_decode_on_random_ids(tok):
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(0, len(tok) if rng.random() < 0.6 else 400) for _ in range(rng.randrange(1, 40))]
        d = IncrementalDetokenizer(tok)
        assert "".join(d.push(i) for i in ids) + d.flush() == tok.decode(ids, skip_special_tokens=True)


def test_out_of_vocab_ids_produce_no_text(tok):
    d = IncrementalDetokenizer(tok)
    ids = tok.encode("Hello world", add_special_tokens=False)
    text = d.push(ids[0]) + d.push(50000) + d.push(ids[1]) + d.flush()
    assert text == "Hello world"


def test_special_tokens_are_skipped(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)
    d = IncrementalDetokenizer(tok)
    assert "".join(d.push(i) for i in ids) + d.flush() == "user\nhi"
