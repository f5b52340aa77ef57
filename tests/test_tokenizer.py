"""Our tokenizer (rosecli.engine.tokenizer) against transformers' PreTrainedTokenizerFast, which
the loader used before for every directory with a tokenizer.json: the same ids, text, special
tokens and chat templates, on the default model's tokenizer and on small GPT-2, BERT and
Llama-style tokenizers built here; and the start path never imports transformers."""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

from rosecli.engine import loader
from rosecli.engine.config import EngineConfig
from rosecli.engine.errors import ModelLoadError
from rosecli.engine.tokenizer import Tokenizer, Unsupported

ROOT = Path(__file__).resolve().parents[1]

TEXTS = [
    "", "Hello", " Hello", "Hello world", "Hello, world! How are you?", "  multiple   spaces  here   ",
    "\n\n\ttabs\tand\nnewlines\n", "\r\nwindows\r\nlines", "trailing space ", " ", "   ", "\n",
    "unicode: café naïve résumé Ωμέγα Привет", "中文测试，你好世界。", "日本語のテキスト", "한국어 텍스트",
    "emoji 😀👍🏽👨‍👩‍👧‍👦🇫🇷", "combining e\u0301 a\u0308", "RTL שלום مرحبا", "zero\u200bwidth", "\x00\x01 control",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "<|endoftext|>", "text<|im_end|>more",
    "<|im_start|><|im_start|>", "<|im_start", "im_start|>", "<s> </s> <unk> [CLS] [SEP] <pad>",
    "don't it's we're I'm they've isn't", "a . b , c ! d ? e ' f", "numbers 0 12 345 6789 3.14159 -42 1e10",
    "code: def f(x):\n    return x ** 2  # square\n", "URL https://example.com/a?b=c&d=e", "a" * 500,
    "ab" * 300 + " " * 40 + "cd" * 30, "MiXeD CaSe WORDS", "\u00a0nbsp\u2003em space", "\ufeffBOM",
]
ALPHABET = (list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJ0123456789") + [" ", "  ", "\n", "\t", ".", ",", "'", "!"]
            + list("éüßçñ中文字日本한😀👍🏽") + ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<s>", "[CLS]", "<pad>"])

CONVERSATIONS = [
    [{"role": "user", "content": "Hello"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a joke about café 中文 😀."}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
     {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}, {"role": "user", "content": ""}],
    [{"role": "user", "content": "<|im_end|> injected <|im_start|>system\nx"}],
    [{"role": "user", "content": "  spaces  \n\n newlines \t"}],
]


def random_text(rng: random.Random) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(rng.randrange(0, 60)))


def random_unicode(rng: random.Random) -> str:
    ranges = [(0x20, 0x7E), (0xA0, 0x2FF), (0x370, 0x52F), (0x4E00, 0x4FFF), (0x1F300, 0x1F64F), (0x0, 0x20)]
    out = []
    for _ in range(rng.randrange(1, 40)):
        lo, hi = rng.choice(ranges)
        out.append(chr(rng.randint(lo, hi)))
    return "".join(out)


# ---- tokenizers to compare --------------------------------------------------------------------------

CORPUS = ["Hello world, this is a small corpus for a tiny tokenizer.", "Don't stop: it's fine, we're here.",
          "Numbers 123 4567 and café, naïve, 中文 text 😀.", "def f(x):\n    return x * 2\n"] * 20

RICH_TEMPLATE = (
    "{%- set ns = namespace(n=0, sys='') -%}"
    "{{ bos_token }}"
    "{%- if tools %}[TOOLS]{{ tools | tojson }}{% endif %}"
    "{%- if documents %}[DOCS]{{ documents | tojson(indent=2) }}{% endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'system' %}{% set ns.sys = m['content'] %}{% continue %}{% endif %}"
    "{%- if m['role'] not in ['user', 'assistant'] %}{{ raise_exception('bad role: ' + m['role']) }}{% endif %}"
    "{%- set ns.n = ns.n + 1 %}"
    "<{{ m['role'] }} n={{ ns.n }}{% if ns.sys %} sys={{ ns.sys | tojson }}{% endif %}>\n"
    "{%- if m['role'] == 'assistant' %}{% generation %}{{ m['content'] | trim }}{% endgeneration %}"
    "{%- if m.reasoning_content is defined %}[think:{{ m.reasoning_content }}|{{ m.thinking }}]{% endif %}"
    "{%- else %}{{ m['content'] }}{% endif %}"
    "{%- if m.name is defined %} (name={{ m.name }}){% endif %}"
    "{{ eos_token }}\n"
    "{%- if ns.n > 20 %}{% break %}{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<assistant>\n{% endif %}"
    "{%- if extra is defined %}[extra={{ extra | tojson }}]{% endif %}"
    "{{ dict(a=1, b='<&>') | tojson }}{{ pad_token }}"
)


def _write(path: Path, backend: Backend, config: dict, special_map=None, template=None) -> Path:
    path.mkdir(parents=True)
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    if special_map is not None:
        (path / "special_tokens_map.json").write_text(json.dumps(special_map))
    if template is not None:
        (path / "chat_template.jinja").write_text(template)
    return path


def gpt2_dir(path: Path) -> Path:
    """GPT-2 style: byte-level BPE, <|endoftext|> for bos/eos/unk, clean_up_tokenization_spaces on
    (transformers 5 ignores it for BPE), a pad token missing from the vocabulary (added on load)."""
    tok = Backend(models.BPE(continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    eot = {"content": "<|endoftext|>", "lstrip": False, "normalized": True, "rstrip": False, "single_word": False,
           "special": True}
    return _write(path, tok, {
        "add_prefix_space": False, "added_tokens_decoder": {"0": eot}, "bos_token": "<|endoftext|>",
        "clean_up_tokenization_spaces": True, "eos_token": "<|endoftext|>", "model_max_length": 1024,
        "pad_token": "<pad>", "tokenizer_class": "GPT2Tokenizer", "unk_token": "<|endoftext|>",
        "chat_template": RICH_TEMPLATE})


def bert_dir(path: Path) -> Path:
    """WordPiece with [CLS] $A [SEP] added by the post-processor, lower-casing, the space clean-up
    (applies to non-BPE models) and token_type_ids among the model inputs."""
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Backend(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(CORPUS, trainers.WordPieceTrainer(vocab_size=300, special_tokens=specials))
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", tok.token_to_id("[CLS]")), ("[SEP]", tok.token_to_id("[SEP]"))])
    return _write(path, tok, {
        "clean_up_tokenization_spaces": True, "do_lower_case": True, "tokenizer_class": "BertTokenizer",
        "cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]", "mask_token": "[MASK]",
        "unk_token": "[UNK]", "model_input_names": ["input_ids", "token_type_ids", "attention_mask"]})


def llama_dir(path: Path) -> Path:
    """Llama style: SentencePiece spaces, byte fallback, <s> added by the post-processor,
    add_bos_token/add_eos_token in the config (ignored with a tokenizer.json), special tokens in
    a legacy special_tokens_map.json, the chat template in chat_template.jinja."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ["▁", "▁hello", "▁world", "hel", "lo", "▁a", "b", "▁你", "好", "▁▁", "e", "l", "o", "h"]:
        vocab[piece] = len(vocab)
    tok = Backend(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    plain = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
    return _write(path, tok, {
        "add_bos_token": True, "add_eos_token": True, "legacy": False, "tokenizer_class": "LlamaTokenizer",
        "model_max_length": 2048, "clean_up_tokenization_spaces": False,
        "chat_template": "ignored: chat_template.jinja wins"},
        special_map={"bos_token": {"content": "<s>", **plain}, "eos_token": "</s>",
                     "unk_token": {"content": "<unk>", **plain}},
        template="{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}"
                 "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")


@pytest.fixture(scope="module")
def smollm2_dir(cache_dir) -> Path:
    """The default model's tokenizer directory, as the loader writes it (the same files as the
    converted smollm2-135m): tests/test_detokenizer.py's fixture, which converts it once."""
    loader.dummy_tokenizer(EngineConfig(cache_dir=cache_dir))
    root = Path(cache_dir)
    for cand in (root / "models" / "smollm2-135m", root / "tokenizers" / "smollm2"):
        if (cand / "tokenizer.json").is_file():
            return cand
    raise AssertionError("no SmolLM2 tokenizer directory in the test cache")


@pytest.fixture(scope="module")
def built_dirs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("tokenizers")
    return {f.__name__: f(root / f.__name__) for f in (gpt2_dir, bert_dir, llama_dir)}


@pytest.fixture(scope="module", params=["smollm2", "gpt2_dir", "bert_dir", "llama_dir"])
def pair(request, smollm2_dir, built_dirs):
    from transformers import PreTrainedTokenizerFast

    path = smollm2_dir if request.param == "smollm2" else built_dirs[request.param]
    ours = loader._tokenizer(path)
    assert type(ours) is Tokenizer, "the loader should take our tokenizer for this directory"
    return request.param, ours, PreTrainedTokenizerFast.from_pretrained(str(path))


# ---- equivalence ----------------------------------------------------------------------------------


def _same_outcome(f, g):
    """Both return the same value, or both raise the same exception type and message."""
    try:
        a = f()
    except Exception as e:
        with pytest.raises(type(e)) as info:
            g()
        assert str(info.value) == str(e)
        return None
    b = g()
    assert a == b
    return a


def test_vocabulary_and_special_tokens(pair):
    name, ours, ref = pair
    assert len(ours) == len(ref) and ours.vocab_size == ref.vocab_size
    assert ours.get_vocab() == ref.get_vocab()
    assert {i: repr(t) for i, t in ours.added_tokens_decoder.items()} == \
           {i: repr(t) for i, t in ref.added_tokens_decoder.items()}
    assert ours.added_tokens_encoder == ref.added_tokens_encoder
    assert ours.all_special_tokens == ref.all_special_tokens
    assert ours.all_special_ids == ref.all_special_ids
    assert ours.special_tokens_map == ref.special_tokens_map
    for attr in ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"):
        assert getattr(ours, attr) == getattr(ref, attr), attr
        assert getattr(ours, attr + "_id") == getattr(ref, attr + "_id"), attr
    assert ours.extra_special_tokens == ref.extra_special_tokens
    assert ours.clean_up_tokenization_spaces == ref.clean_up_tokenization_spaces
    assert ours.split_special_tokens == ref.split_special_tokens
    assert ours.chat_template == ref.chat_template
    assert ours.model_max_length == ref.model_max_length
    assert ours.model_input_names == ref.model_input_names
    # what the detokenizer reads of the backend
    assert str(ours.backend_tokenizer.decoder) == str(ref.backend_tokenizer.decoder)
    assert type(ours.backend_tokenizer.model).__name__ == type(ref.backend_tokenizer.model).__name__
    assert str(ours.backend_tokenizer.post_processor) == str(ref.backend_tokenizer.post_processor)
    tokens = list(ref.get_vocab())[:50] + ["<|im_start|>", "<0x0A>", "not-a-token-\u2603", "Ġthe", "##s", "▁"]
    assert ours.convert_tokens_to_ids(tokens) == ref.convert_tokens_to_ids(tokens)
    assert ours.convert_tokens_to_ids("\u2603 nope") == ref.convert_tokens_to_ids("\u2603 nope")
    ids = list(range(0, len(ref), max(1, len(ref) // 300)))
    assert ours.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids)
    assert ours.convert_ids_to_tokens(ids, skip_special_tokens=True) == \
           ref.convert_ids_to_tokens(ids, skip_special_tokens=True)


def test_encode(pair):
    name, ours, ref = pair
    rng = random.Random(3)
    texts = TEXTS + [random_text(rng) for _ in range(300)] + [random_unicode(rng) for _ in range(300)]
    for text in texts:
        for add in (True, False):
            assert ours.encode(text, add_special_tokens=add) == ref.encode(text, add_special_tokens=add), (name, text)
        assert ours.encode(text) == ref.encode(text)
        assert ours.encode(text, split_special_tokens=True) == ref.encode(text, split_special_tokens=True)
        assert dict(ours(text)) == dict(ref(text)), (name, text)
        assert dict(ours(text, add_special_tokens=False)) == dict(ref(text, add_special_tokens=False))
    assert dict(ours(texts[:40])) == dict(ref(texts[:40]))
    assert ours.encode("Hello", "world") == ref.encode("Hello", "world")
    assert dict(ours(["a b", "c"], ["d", "e f"])) == dict(ref(["a b", "c"], ["d", "e f"]))
    assert ours("Hello").input_ids == ref("Hello").input_ids
    # the tokenizer's own state is not changed by a call that splits special tokens
    assert ours.encode("<|im_start|>") == ref.encode("<|im_start|>")


def test_decode(pair):
    name, ours, ref = pair
    rng = random.Random(5)
    n = len(ref)
    special = sorted(set(ref.all_special_ids))
    for case in range(600):
        k = rng.randrange(0, 40)
        if case % 3 == 0:  # mostly special and low ids (bytes, added tokens)
            ids = [rng.choice(special + list(range(min(n, 300)))) for _ in range(k)]
        else:
            ids = [rng.randrange(0, n) for _ in range(k)]
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), (name, ids)
        assert ours.decode(ids, clean_up_tokenization_spaces=True) == ref.decode(ids, clean_up_tokenization_spaces=True)
        assert ours.decode(ids, clean_up_tokenization_spaces=False) == \
               ref.decode(ids, clean_up_tokenization_spaces=False)
    for text in TEXTS:
        ids = ref.encode(text)
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), (name, text)
    # one id, a batch, ids past the vocabulary (a dummy gpt2 has 50,257 logits), a tensor, a bad id
    assert ours.decode(special[0]) == ref.decode(special[0])
    batch = [ref.encode("Hello world"), ref.encode("café 😀")]
    assert ours.decode(batch) == ref.decode(batch) and ours.batch_decode(batch) == ref.batch_decode(batch)
    assert ours.decode(batch[0] + [n, n + 1000]) == ref.decode(batch[0] + [n, n + 1000])
    import torch

    assert ours.decode(torch.tensor(batch[0])) == ref.decode(torch.tensor(batch[0]))
    _same_outcome(lambda: ours.decode([-1]), lambda: ref.decode([-1]))


def test_chat_template(pair):
    name, ours, ref = pair
    if ref.chat_template is None:  # the same ValueError
        _same_outcome(lambda: ours.apply_chat_template(CONVERSATIONS[0]),
                      lambda: ref.apply_chat_template(CONVERSATIONS[0]))
        return
    for conv in CONVERSATIONS:
        for gen in (True, False):
            for tokenize in (True, False):
                a = _same_outcome(lambda: ours.apply_chat_template(conv, add_generation_prompt=gen, tokenize=tokenize),
                                  lambda: ref.apply_chat_template(conv, add_generation_prompt=gen, tokenize=tokenize))
                if tokenize and a is not None:
                    assert set(a) == {"input_ids", "attention_mask"}
            assert ours.apply_chat_template(conv, add_generation_prompt=gen, tokenize=True, return_dict=False) == \
                   ref.apply_chat_template(conv, add_generation_prompt=gen, tokenize=True, return_dict=False)
        # what llm.py and the server call
        assert ours.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)["input_ids"] == \
               list(ref.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)["input_ids"])
    # an assistant answer left open (vLLM's continue_final_message: a prefilled reply), with a template that keeps
    # the message's trailing space and one that strips it
    for prefill in ("Sure, here", "Sure, here ", "  Well\n", "café 😀"):
        conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": prefill}]
        for tokenize in (True, False):
            _same_outcome(lambda: ours.apply_chat_template(conv, continue_final_message=True, tokenize=tokenize,
                                                           return_dict=False),
                          lambda: ref.apply_chat_template(conv, continue_final_message=True, tokenize=tokenize,
                                                          return_dict=False))
        assert ours.apply_chat_template(conv, continue_final_message=True, tokenize=False).rstrip().endswith(
            prefill.strip())
    # a batch of conversations, and the empty conversation
    assert ours.apply_chat_template(CONVERSATIONS[:3], tokenize=False) == \
           ref.apply_chat_template(CONVERSATIONS[:3], tokenize=False)
    assert dict(ours.apply_chat_template(CONVERSATIONS[:3])) == dict(ref.apply_chat_template(CONVERSATIONS[:3]))
    _same_outcome(lambda: ours.apply_chat_template([]), lambda: ref.apply_chat_template([]))


def test_chat_template_features(built_dirs):
    """The sandbox's helpers (raise_exception, tojson, namespace, dict, loop controls, the
    generation tag), template variables, None fields, reasoning aliases, tools and documents."""
    from transformers import PreTrainedTokenizerFast

    path = built_dirs["gpt2_dir"]
    ours, ref = loader._tokenizer(path), PreTrainedTokenizerFast.from_pretrained(str(path))

    def both(conv, **kw):
        return _same_outcome(lambda: ours.apply_chat_template(conv, tokenize=False, **kw),
                             lambda: ref.apply_chat_template(conv, tokenize=False, **kw))

    base = [{"role": "system", "content": "be <nice> & \"kind\" é"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "  hello  ", "name": "bot"}, {"role": "user", "content": "more"}]
    assert "bad role" not in both(base, add_generation_prompt=True)
    both(base + [{"role": "tool", "content": "x"}])  # raise_exception: the same TemplateError
    with pytest.raises(Exception, match="bad role: tool"):
        ours.apply_chat_template(base + [{"role": "tool", "content": "x"}], tokenize=False)
    both([{"role": "user", "content": "hi", "name": None}, {"role": "assistant", "content": "a",
                                                            "reasoning": "because"}])
    both([{"role": "assistant", "content": "a", "thinking": "t"}])
    both(base, extra={"k": ["v", 1, 2.5, None, True], "u": "ü<>"})
    both(base, tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
         documents=[{"title": "T", "text": "doc é"}])
    both(base, bos_token="OVERRIDE")  # kwargs override the special tokens
    both([{"role": "user", "content": str(i)} for i in range(30)])  # {% break %}
    # templates passed in the call, and the sandbox refusing what it must
    for template in ["{{ messages[0].__class__ }}", "{% set ns = namespace(_x=1) %}{{ ns._x }}",
                     "{{ strftime_now('%Y') }}", "{{ raise_exception('no') }}", "{{ 'x' | tojson }}{{ [1] | tojson }}",
                     "{% for m in messages %}{{ loop.index }}{% if loop.first %}{% continue %}{% endif %}x{% endfor %}",
                     "{{ messages | tojson(indent=1, sort_keys=True) }}", "{{ ''.__class__.__mro__ }}",
                     "{{ unk_token }}{{ pad_token }}{{ add_generation_prompt }}"]:
        both(base, chat_template=template, add_generation_prompt=True)
    both(base[:-1], continue_final_message=True)  # the assistant's "  hello  " left open
    with pytest.raises(NotImplementedError):
        ours.apply_chat_template(base, continue_final_message="reasoning_content")
    # a tokenizer without a chat template
    bert = built_dirs["bert_dir"]
    b_ours, b_ref = loader._tokenizer(bert), PreTrainedTokenizerFast.from_pretrained(str(bert))
    assert b_ours.chat_template is None
    _same_outcome(lambda: b_ours.apply_chat_template(base), lambda: b_ref.apply_chat_template(base))


def test_saved_copy_loads_the_same(pair, tmp_path):
    name, ours, ref = pair
    ours.save_pretrained(tmp_path / "copy")
    again = loader._tokenizer(tmp_path / "copy")
    assert type(again) is Tokenizer and len(again) == len(ours) and again.get_vocab() == ours.get_vocab()
    assert again.all_special_ids == ours.all_special_ids and again.chat_template == ours.chat_template
    assert again.encode("Hello <|im_start|> world") == ref.encode("Hello <|im_start|> world")


# ---- what goes to transformers --------------------------------------------------------------------


@pytest.mark.parametrize("change", ["fast_tokenizer_files", "fix_mistral_regex", "added_tokens_json",
                                    "template_dict", "template_dir", "map_extra"])
def test_what_we_do_not_reproduce_goes_to_transformers(built_dirs, tmp_path, change):
    import shutil

    from transformers import PreTrainedTokenizerFast

    path = tmp_path / "tok"
    shutil.copytree(built_dirs["llama_dir"], path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    if change == "fast_tokenizer_files":
        config["fast_tokenizer_files"] = ["tokenizer.json"]
    elif change == "fix_mistral_regex":
        config["fix_mistral_regex"] = False
    elif change == "added_tokens_json":
        (path / "added_tokens.json").write_text(json.dumps({"<extra>": 276}))
    elif change == "template_dict":
        (path / "chat_template.jinja").unlink()
        config["chat_template"] = [{"name": "default", "template": "{{ messages[0]['content'] }}"}]
    elif change == "template_dir":
        (path / "additional_chat_templates").mkdir()
        (path / "additional_chat_templates" / "tool_use.jinja").write_text("{{ 1 }}")
    elif change == "map_extra":
        (path / "special_tokens_map.json").write_text(json.dumps({"eos_token": "</s>",
                                                                   "additional_special_tokens": ["<x>"]}))
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(Unsupported):
        Tokenizer.from_dir(path)
    tok = loader._tokenizer(path)
    assert isinstance(tok, PreTrainedTokenizerFast)
    assert tok.encode("hello world") == PreTrainedTokenizerFast.from_pretrained(str(path)).encode("hello world")


def test_unreadable_tokenizer_is_named(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=f"cannot load the tokenizer from {tmp_path}"):
        loader._tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match=f"{tmp_path} has no tokenizer files"):
        loader._tokenizer(tmp_path)


# ---- transformers stays out of the start path ------------------------------------------------------


def _run_python(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def test_loading_the_tokenizer_does_not_import_transformers(smollm2_dir):
    r = _run_python(
        "import sys\n"
        "from pathlib import Path\n"
        "from rosecli.engine.loader import _tokenizer\n"
        f"tok = _tokenizer(Path({str(smollm2_dir)!r}))\n"
        "ids = tok.apply_chat_template([{'role': 'user', 'content': 'Hi'}], add_generation_prompt=True)['input_ids']\n"
        "assert tok.decode(ids, skip_special_tokens=True).endswith('Hi\\nassistant\\n'), tok.decode(ids)\n"
        "assert type(tok).__module__ == 'rosecli.engine.tokenizer', type(tok)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'transformers')\n"
        "assert not bad, bad\n")
    assert r.returncode == 0, r.stderr


def test_rose_generate_does_not_import_transformers(smollm2_dir, cache_dir):
    """The whole `rose generate` run, from the CLI to the last token (a dummy model on the cached
    SmolLM2 tokenizer: the same code path as the default model's, without converting it)."""
    r = _run_python(
        "import runpy, sys\n"
        "sys.argv = ['rose', 'generate', 'Hello', '--model', 'tiny-llama', '--load-format', 'dummy', '--chat',\n"
        f"            '--cache-dir', {cache_dir!r}, '--device', 'cpu', '--max-new-tokens', '4']\n"
        "try:\n"
        "    runpy.run_module('rosecli', run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    assert not e.code, e.code\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'transformers')\n"
        "assert not bad, bad\n")
    assert r.returncode == 0, r.stderr
