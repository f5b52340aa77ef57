"""A tokenizer read straight from ``tokenizer.json`` with the ``tokenizers`` library.

``import transformers`` alone costs about a second of start-up, and building its
``PreTrainedTokenizerFast`` another quarter; this class gives what rosecli uses of that tokenizer
(``encode``, ``decode``, ``__call__``, ``apply_chat_template``, the special tokens and the
vocabulary) with the same results, in about 0.1 s and without importing transformers. The
reference is transformers 5's ``PreTrainedTokenizerFast.from_pretrained(directory)`` (its class
``TokenizersBackend``), which the loader used for every directory with a tokenizer.json:

* loading reads tokenizer.json, tokenizer_config.json (``tokenizer_class``, ``add_bos_token`` and
  ``add_eos_token`` ignored, as transformers does when tokenizer.json is present),
  chat_template.jinja (preferred to the config's template) and, when the config has no
  ``added_tokens_decoder``, special_tokens_map.json; the added tokens of the config and the
  special tokens missing from the added vocabulary are added to the backend as transformers adds
  them, and padding and truncation stored in tokenizer.json are off (transformers turns them off
  on every call that does not ask for them);
* ``decode`` skips ``clean_up_tokenization_spaces`` for BPE models, as transformers 5 does unless
  ``clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output`` is set;
* chat templates render in the same sandbox: ``ImmutableSandboxedEnvironment`` with
  ``trim_blocks``/``lstrip_blocks``, the ``loopcontrols`` extension, a ``{% generation %}`` tag,
  ``raise_exception``, ``strftime_now``, transformers' ``tojson`` filter and its restricted
  ``dict`` and ``namespace``; the special tokens are template variables; messages' ``None`` values
  are dropped, everything the template sees is rebuilt from plain data, and reasoning fields are
  aliased.

What this class does not reproduce raises ``Unsupported`` at load time (the loader then uses
transformers): versioned ``fast_tokenizer_files``, several named chat templates,
``fix_mistral_regex``, a legacy ``added_tokens.json``, special_tokens_map.json entries other than
the seven named tokens. Calls with options rosecli does not use (padding, truncation, tensors,
``continue_final_message``, assistant masks, control-token sanitizing) are a ``TypeError`` or
``NotImplementedError``, never a different result.
"""

from __future__ import annotations

import json
import shutil
import sys
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional, Union

from tokenizers import AddedToken
from tokenizers import Tokenizer as Backend

# transformers' PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES
SPECIAL_TOKENS_ATTRIBUTES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                             "mask_token")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_VERY_LARGE_INTEGER = int(1e30)  # transformers' default model_max_length


class Unsupported(Exception):
    """The directory needs something of transformers' loader that this class does not reproduce."""


class Encoding(dict):
    """What ``__call__`` and a tokenized ``apply_chat_template`` return: a dict of lists, whose
    keys also read as attributes (``enc.input_ids``), like transformers' BatchEncoding."""

    def __getattr__(self, key):
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None


def _read_json(path: Path) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _added_token(value: Any) -> Any:
    """transformers' convert_added_tokens(save=False): {"__type": "AddedToken", ...} dicts, also
    nested in lists and dicts, become AddedToken."""
    if isinstance(value, dict) and value.get("__type") == "AddedToken":
        fields = dict(value)
        fields.pop("__type")
        return AddedToken(**fields)
    if isinstance(value, (list, tuple)):
        return [_added_token(v) for v in value]
    if isinstance(value, dict):
        return {k: _added_token(v) for k, v in value.items()}
    return value


class Tokenizer:
    """See the module docstring. Build with ``Tokenizer.from_dir(path)``."""

    is_fast = True
    padding_side = "right"
    truncation_side = "right"

    def __init__(self, backend: Backend, config: dict, name_or_path: str = "", files: tuple = ()):
        """``config``: tokenizer_config.json as transformers passes it to the tokenizer class
        (``from_dir`` prepares it)."""
        self._tokenizer = backend
        self.name_or_path = name_or_path
        self._files = files
        kw = dict(config)
        # TokenizersBackend.__init__: the padding stored in tokenizer.json names the pad token
        padding = backend.padding
        if padding is not None:
            kw.setdefault("pad_token", padding["pad_token"])
        # ... and a missing post-processor becomes an empty template (add_bos/eos_token are off)
        if backend.post_processor is None:
            from tokenizers import processors

            backend.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1",
                                                                   special_tokens=[])
        # every call of transformers' tokenizer without padding/truncation turns them off
        backend.no_padding()
        backend.no_truncation()

        # PreTrainedTokenizerBase.__init__
        if "additional_special_tokens" in kw and "extra_special_tokens" not in kw:
            kw["extra_special_tokens"] = kw.pop("additional_special_tokens")
        self._special_attrs = list(SPECIAL_TOKENS_ATTRIBUTES)
        self._special_tokens_map: dict[str, Any] = dict.fromkeys(SPECIAL_TOKENS_ATTRIBUTES)
        self._extra_special_tokens: list = []
        explicit = kw.pop("model_specific_special_tokens", None) or {}
        auto = {}
        for key in list(kw):
            if key in SPECIAL_TOKENS_ATTRIBUTES:
                value = kw.pop(key)
                if value is None:
                    continue
                if not isinstance(value, (str, AddedToken)):
                    raise Unsupported(f"special token {key} is neither a string nor an AddedToken")
                self._special_tokens_map[key] = value
            elif key == "extra_special_tokens":
                value = kw.pop(key)
                if value is None:
                    continue
                if isinstance(value, dict):
                    self._set_model_specific(value)
                elif isinstance(value, (list, tuple)):
                    self._extra_special_tokens = list(value)
                else:
                    raise Unsupported("extra_special_tokens is neither a list nor a dict")
            elif key.endswith("_token") and isinstance(kw[key], (str, AddedToken)):
                auto[key] = kw.pop(key)
        model_max_length = kw.pop("model_max_length", kw.pop("max_len", None))
        self.model_max_length = model_max_length if model_max_length is not None else _VERY_LARGE_INTEGER
        self.padding_side = kw.pop("padding_side", self.padding_side)
        self.truncation_side = kw.pop("truncation_side", self.truncation_side)
        self.model_input_names = list(kw.pop("model_input_names", ["input_ids", "attention_mask"]))
        self.clean_up_tokenization_spaces = kw.pop("clean_up_tokenization_spaces", False)
        self.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = kw.pop(
            "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
        self.split_special_tokens = kw.pop("split_special_tokens", False)
        self.chat_template = kw.pop("chat_template", None)
        if {**auto, **explicit}:
            self._set_model_specific({**auto, **explicit})
        self.init_kwargs = kw

        # TokenizersBackend.__init__, after the base class: special tokens the added vocabulary
        # lacks are added. transformers compares the config's added tokens against the ids of the
        # backend's (a dict's keys), so every one of them is passed to add_tokens again, where an
        # identical token is a no-op and a token with other flags replaces the backend's.
        backend.encode_special_tokens = self.split_special_tokens
        added_decoder = kw.get("added_tokens_decoder") or {}
        to_add = [token for _, token in sorted(added_decoder.items(), key=lambda x: x[0])]
        encoder = list(self.added_tokens_encoder) + [str(t) for t in to_add]
        for value in self._special_tokens_map.values():
            if value is not None and str(value) not in encoder and value not in to_add:
                to_add.append(value)
        for value in self._extra_special_tokens:
            if str(value) not in encoder and value not in to_add:
                to_add.append(value)
        if to_add:
            named = [str(t) for t in self._special_tokens_map.values() if t]
            tokens = []
            for token in to_add:
                if isinstance(token, str):
                    token = AddedToken(token, special=True)
                elif isinstance(token, AddedToken):
                    if not token.special and str(token) in named:
                        token.special = True
                else:
                    raise Unsupported(f"added token {token!r} is neither a string nor an AddedToken")
                tokens.append(token)
            backend.add_tokens(tokens)

    def _set_model_specific(self, tokens: dict) -> None:
        self._special_attrs = self._special_attrs + list(tokens)
        for key, value in tokens.items():
            if not isinstance(value, (str, AddedToken)):
                raise Unsupported(f"special token {key} is neither a string nor an AddedToken")
            self._special_tokens_map[key] = value

    # ---- loading ------------------------------------------------------------------------------
    @classmethod
    def from_dir(cls, path: Union[str, Path]) -> "Tokenizer":
        """The tokenizer of a directory with tokenizer.json, as PreTrainedTokenizerFast.from_pretrained
        builds it. Raises ``Unsupported`` for what only transformers handles; errors reading the
        files propagate (the caller falls back to transformers, which reports them)."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise Unsupported("no tokenizer.json")
        config_file = path / "tokenizer_config.json"
        config = _read_json(config_file) if config_file.is_file() else {}
        if not isinstance(config, dict):
            raise Unsupported("tokenizer_config.json is not a JSON object")
        for key in ("fast_tokenizer_files", "fix_mistral_regex"):
            if key in config:
                raise Unsupported(f"tokenizer_config.json sets {key}")
        if (path / "additional_chat_templates").is_dir():
            raise Unsupported("several named chat templates")
        if isinstance(config.get("chat_template"), (list, tuple, dict)):
            raise Unsupported("several named chat templates")
        config.pop("tokenizer_class", None)
        config.pop("init_inputs", None)
        config.pop("add_bos_token", None)  # ignored by transformers when there is a tokenizer.json
        config.pop("add_eos_token", None)
        files = [path / "tokenizer.json"] + ([config_file] if config_file.is_file() else [])
        template_file = path / "chat_template.jinja"
        if template_file.is_file():
            config["chat_template"] = template_file.read_text(encoding="utf-8")
            files.append(template_file)
        if "additional_special_tokens" in config and not config.get("extra_special_tokens"):
            config["extra_special_tokens"] = config.pop("additional_special_tokens")
        model_specific = {key: config.pop(key) for key in list(config)
                          if key not in SPECIAL_TOKENS_ATTRIBUTES and key.endswith("_token")
                          and isinstance(config[key], (str, AddedToken))}
        if isinstance(config.get("extra_special_tokens"), dict):
            model_specific.update(config.pop("extra_special_tokens"))
        if model_specific:
            config["model_specific_special_tokens"] = model_specific

        backend = Backend.from_file(str(path / "tokenizer.json"))
        added_decoder: dict[int, AddedToken] = {}
        added_map: dict[str, AddedToken] = {}
        if "added_tokens_decoder" in config:
            for idx, token in config["added_tokens_decoder"].items():
                if isinstance(token, dict):
                    token = AddedToken(**token)
                if not isinstance(token, AddedToken):
                    raise Unsupported("an entry of added_tokens_decoder is not a token")
                added_decoder[int(idx)] = token
                added_map[str(token)] = token
        else:
            if (path / "added_tokens.json").is_file():
                raise Unsupported("a legacy added_tokens.json")
            map_file = path / "special_tokens_map.json"
            if map_file.is_file():
                special_map = _read_json(map_file)
                if not isinstance(special_map, dict) or any(k not in SPECIAL_TOKENS_ATTRIBUTES for k in special_map):
                    raise Unsupported("special_tokens_map.json holds more than the named special tokens")
                for key, value in special_map.items():
                    if isinstance(value, dict):
                        value = dict(value)
                        value.pop("special", None)
                        value = AddedToken(**value, special=True)
                    config[key] = value
                files.append(map_file)
            # tokenizer.json's "added_tokens", as the backend read them
            for idx, token in backend.get_added_tokens_decoder().items():
                added_decoder[idx] = token
                added_map[str(token)] = token
        config["added_tokens_decoder"] = added_decoder
        config = _added_token(config)
        for key in SPECIAL_TOKENS_ATTRIBUTES:
            if config.get(key) is not None and added_map:
                config[key] = added_map.get(str(config[key]), config[key])
        return cls(backend, config, str(path), tuple(files))

    def save_pretrained(self, save_directory: Union[str, Path]) -> tuple[str, ...]:
        """Copies the files this tokenizer was read from: loading them gives the same tokenizer."""
        out = Path(save_directory)
        out.mkdir(parents=True, exist_ok=True)
        written = []
        for f in self._files:
            shutil.copyfile(f, out / f.name)
            written.append(str(out / f.name))
        return tuple(written)

    # ---- vocabulary and special tokens -----------------------------------------------------
    @property
    def backend_tokenizer(self) -> Backend:
        return self._tokenizer

    @property
    def decoder(self):
        return self._tokenizer.decoder

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def __bool__(self) -> bool:
        return True

    def get_vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    @property
    def vocab(self) -> dict[str, int]:
        return self.get_vocab()

    @property
    def added_tokens_decoder(self) -> dict[int, AddedToken]:
        return self._tokenizer.get_added_tokens_decoder()

    @property
    def added_tokens_encoder(self) -> dict[str, int]:
        return {t.content: i for i, t in sorted(self.added_tokens_decoder.items(), key=lambda x: x[0])}

    def get_added_vocab(self) -> dict[str, int]:
        return self.added_tokens_encoder

    def convert_tokens_to_ids(self, tokens: Union[str, list[str]]):
        if isinstance(tokens, str):
            return self._token_to_id(tokens)
        return [self._token_to_id(t) for t in tokens]

    def _token_to_id(self, token: str) -> Optional[int]:
        index = self._tokenizer.token_to_id(token)
        return self.unk_token_id if index is None else index

    def convert_ids_to_tokens(self, ids, skip_special_tokens: bool = False):
        if isinstance(ids, int):
            return self._tokenizer.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._tokenizer.id_to_token(int(i)) for i in ids if int(i) not in skip]

    def __getattr__(self, key: str):
        # bos_token, bos_token_id, ... and model-specific ones (transformers' __getattr__)
        if key.startswith("__") or key in ("_special_attrs", "_special_tokens_map", "_extra_special_tokens",
                                           "_tokenizer"):
            raise AttributeError(key)
        base = key.removesuffix("_ids").removesuffix("_id") if key.endswith(("_id", "_ids")) else key
        if base in self._special_attrs:
            value = self._special_tokens_map.get(base)
            if value is None:
                return None
            return self.convert_tokens_to_ids(str(value)) if key != base else str(value)
        if base == "extra_special_tokens":
            tokens = [str(t) for t in self._extra_special_tokens]
            return self.convert_tokens_to_ids(tokens) if key != base else tokens
        raise AttributeError(f"{type(self).__name__} has no attribute {key}")

    @property
    def special_tokens_map(self) -> dict[str, str]:
        return {a: str(self._special_tokens_map[a]) for a in self._special_attrs
                if self._special_tokens_map.get(a) is not None}

    @property
    def all_special_tokens(self) -> list[str]:
        seen: dict[str, None] = {}
        for attr in self._special_attrs:
            value = self._special_tokens_map.get(attr)
            if value is not None:
                seen.setdefault(str(value))
        for token in self._extra_special_tokens:
            seen.setdefault(str(token))
        return list(seen)

    @property
    def all_special_ids(self) -> list[int]:
        return self.convert_tokens_to_ids(self.all_special_tokens)

    # ---- encoding ---------------------------------------------------------------------------
    def _encode_ids(self, batch: list, add_special_tokens: bool, split_special_tokens: Optional[bool]) -> list:
        split = self.split_special_tokens if split_special_tokens is None else split_special_tokens
        if self._tokenizer.encode_special_tokens != split:
            self._tokenizer.encode_special_tokens = split
        return self._tokenizer.encode_batch(batch, add_special_tokens=add_special_tokens)

    def encode(self, text: str, text_pair: Optional[str] = None, add_special_tokens: bool = True,
               split_special_tokens: Optional[bool] = None) -> list[int]:
        if not isinstance(text, str) or not (text_pair is None or isinstance(text_pair, str)):
            raise TypeError("encode takes a string (and optionally a second string)")
        item = (text, text_pair) if text_pair else text
        return self._encode_ids([item], add_special_tokens, split_special_tokens)[0].ids

    def __call__(self, text: Union[str, list[str]], text_pair: Union[str, list[str], None] = None,
                 add_special_tokens: bool = True, split_special_tokens: Optional[bool] = None,
                 return_token_type_ids: Optional[bool] = None,
                 return_attention_mask: Optional[bool] = None) -> Encoding:
        batched = isinstance(text, (list, tuple))
        if batched:
            if not all(isinstance(t, str) for t in text):
                raise TypeError("text must be a string or a list of strings")
            if isinstance(text_pair, str):
                raise TypeError("when tokenizing batches of text, `text_pair` must be a list or tuple with the "
                                "same length as `text`.")
            if text_pair is not None and len(text) != len(text_pair):
                raise ValueError(f"batch length of `text`: {len(text)} does not match batch length of "
                                 f"`text_pair`: {len(text_pair)}.")
            items = list(zip(text, text_pair)) if text_pair is not None else list(text)
        elif isinstance(text, str):
            items = [(text, text_pair)] if text_pair else [text]
        else:
            raise TypeError("text must be a string or a list of strings")
        encodings = self._encode_ids(items, add_special_tokens, split_special_tokens)
        if return_token_type_ids is None:
            return_token_type_ids = "token_type_ids" in self.model_input_names
        if return_attention_mask is None:
            return_attention_mask = "attention_mask" in self.model_input_names
        out = Encoding(input_ids=[e.ids for e in encodings])
        if return_token_type_ids:
            out["token_type_ids"] = [e.type_ids for e in encodings]
        if return_attention_mask:
            out["attention_mask"] = [e.attention_mask for e in encodings]
        if not batched:
            out = Encoding({k: v[0] for k, v in out.items()})
        return out

    # ---- decoding ---------------------------------------------------------------------------
    def decode(self, token_ids, skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: Optional[bool] = None) -> Union[str, list[str]]:
        if hasattr(token_ids, "tolist"):  # tensors, arrays, numpy scalars (transformers' to_py_obj)
            token_ids = token_ids.tolist()
        if isinstance(token_ids, (list, tuple)) and token_ids and isinstance(token_ids[0], (list, tuple)):
            return [self._decode(seq, skip_special_tokens, clean_up_tokenization_spaces) for seq in token_ids]
        return self._decode(token_ids, skip_special_tokens, clean_up_tokenization_spaces)

    def batch_decode(self, sequences, skip_special_tokens: bool = False,
                     clean_up_tokenization_spaces: Optional[bool] = None) -> list[str]:
        result = self.decode(sequences, skip_special_tokens, clean_up_tokenization_spaces)
        return [result] if isinstance(result, str) else result

    def _decode(self, token_ids, skip_special_tokens: bool, clean_up: Optional[bool]) -> str:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        if isinstance(token_ids, dict):
            token_ids = token_ids["input_ids"]
        text = self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
        clean_up = self.clean_up_tokenization_spaces if clean_up is None else clean_up
        # transformers 5 leaves BPE output alone (the clean-up strips legitimate spaces there)
        if clean_up and (type(self._tokenizer.model).__name__ != "BPE"
                         or self.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output):
            text = self.clean_up_tokenization(text)
        return text

    @staticmethod
    def clean_up_tokenization(text: str) -> str:
        return (text.replace(" .", ".").replace(" ?", "?").replace(" !", "!").replace(" ,", ",")
                .replace(" ' ", "'").replace(" n't", "n't").replace(" 'm", "'m").replace(" 's", "'s")
                .replace(" 've", "'ve").replace(" 're", "'re"))

    # ---- chat templates ---------------------------------------------------------------------
    def get_chat_template(self, chat_template: Optional[str] = None, tools: Optional[list] = None) -> str:
        if chat_template is None:
            if self.chat_template is None:
                raise ValueError(
                    "Cannot use chat template functions because tokenizer.chat_template is not set and no template "
                    "argument was passed! For information about writing templates and setting the "
                    "tokenizer.chat_template attribute, please see the documentation at "
                    "https://huggingface.co/docs/transformers/main/en/chat_templating")
            chat_template = self.chat_template
        return chat_template

    def apply_chat_template(self, conversation, tools: Optional[list] = None, documents: Optional[list] = None,
                            chat_template: Optional[str] = None, add_generation_prompt: bool = False,
                            continue_final_message: Union[bool, str] = False, tokenize: bool = True,
                            return_dict: bool = True, **kwargs):
        """transformers' apply_chat_template without padding, truncation, tensors, assistant masks or
        control-token sanitizing, and ``continue_final_message`` for the message's content only (not a reasoning
        field). As in transformers 5, ``tokenize=True`` returns a dict (``input_ids``, ``attention_mask``) unless
        ``return_dict=False``."""
        if continue_final_message not in (False, True, "content"):
            raise NotImplementedError("continue_final_message on a field other than content needs transformers' "
                                      "tokenizer")
        for key in ("return_assistant_tokens_mask", "sanitize_control_tokens", "padding", "truncation",
                    "max_length", "return_tensors", "tokenizer_kwargs"):
            if kwargs.get(key):
                raise NotImplementedError(f"{key} needs transformers' tokenizer")
            kwargs.pop(key, None)
        template = self.get_chat_template(chat_template, tools)
        if isinstance(conversation, (list, tuple)) and len(conversation) == 0:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        if isinstance(conversation, (list, tuple)) and (isinstance(conversation[0], (list, tuple))
                                                        or hasattr(conversation[0], "messages")):
            conversations, batched = conversation, True
        else:
            conversations, batched = [conversation], False
        conversations = [[{k: v for k, v in msg.items() if v is not None} for msg in getattr(c, "messages", c)]
                         for c in conversations]
        rendered = render(conversations, template, tools, documents, add_generation_prompt,
                          {**self.special_tokens_map, **kwargs}, bool(continue_final_message))
        text = rendered if batched else rendered[0]
        if not tokenize:
            return text
        out = self(text, add_special_tokens=False)
        return out if return_dict else out["input_ids"]

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(name_or_path='{self.name_or_path}', vocab_size={self.vocab_size}, "
                f"special_tokens={self.special_tokens_map})")


# ---- chat template rendering: transformers.utils.chat_template_utils, without transformers -------


def _plain_template_data(value: Any) -> Any:
    """Everything a template sees is rebuilt from plain JSON-like types; other objects become an
    inert placeholder naming their type (transformers' _plain_template_data)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    from collections.abc import Mapping

    if isinstance(value, Mapping):
        return {_plain_template_data(k): _plain_template_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain_template_data(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain_template_data(v) for v in value)
    np = sys.modules.get("numpy")
    if np is not None and isinstance(value, np.generic):
        return _plain_template_data(value.item())
    import dataclasses

    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain_template_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain_template_data(value.model_dump())
    return f"<{type(value).__name__}>"


def _alias_reasoning_fields(chat: list) -> list:
    out = []
    for message in chat:
        if isinstance(message, dict):
            reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


_OPEN_END = "ROSE_CONTINUE_HERE "  # marks the end of the message to continue (``continue_final_message``)


def _mark_open_end(chat: list[dict], chat_template: str) -> str:
    """Put `_OPEN_END` after the last message's text (its content, or its last text block); returns that text."""
    if not chat:
        raise ValueError("continue_final_message: the conversation is empty, there is no message to continue")
    last = chat[-1]
    content = last.get("content")
    if content is None:
        raise ValueError("continue_final_message: the last message has no content to continue")
    if "content" not in chat_template:
        raise ValueError("continue_final_message: this chat template never shows a message's content")
    if isinstance(content, str):
        last["content"] = content + _OPEN_END
        return content
    for block in reversed(content):
        if isinstance(block, dict) and "text" in block:
            text = block["text"]
            block["text"] = text + _OPEN_END
            return text
    raise ValueError("continue_final_message: the last message has no text block to continue")


def _cut_at_open_end(rendered: str, text: str) -> str:
    """The rendered chat up to the end of the continued message's text (a template that strips the message's
    trailing space drops the marker's too: then the spaces before the cut go as well)."""
    mark = _OPEN_END.strip()
    if text.strip() not in rendered or mark not in rendered:
        raise ValueError("continue_final_message: the chat template's output does not hold the last message's text "
                         "whole (the template changes or drops part of it)")
    at = rendered.rindex(mark)
    return rendered[:at] if rendered.startswith(_OPEN_END, at) else rendered[:at].rstrip()


def render(conversations: list, chat_template: str, tools: Optional[list], documents: Optional[list],
           add_generation_prompt: bool, template_kwargs: dict, continue_final_message: bool = False) -> list[str]:
    compiled = _compile(chat_template)
    if tools is not None:
        schemas = []
        for tool in tools:
            if isinstance(tool, dict):
                schemas.append(tool)
            elif callable(tool):  # a function described by its signature and docstring: transformers' job
                from transformers.utils.chat_template_utils import get_json_schema

                schemas.append(get_json_schema(tool))
            else:
                raise ValueError("Tools should either be a JSON schema, or a callable function with type hints "
                                 "and a docstring suitable for auto-conversion to a schema.")
        tools = schemas
    if documents is not None:
        for document in documents:
            if not isinstance(document, dict):
                raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
    tools = _plain_template_data(tools)
    documents = _plain_template_data(documents)
    template_kwargs = _plain_template_data(template_kwargs)
    rendered = []
    for chat in conversations:
        chat = _plain_template_data(chat)
        for message in chat:
            if not isinstance(message, dict):
                raise TypeError(f"Chat messages should be dicts, dataclasses or pydantic models, but got {message!r}.")
        chat = _alias_reasoning_fields(chat)
        text = _mark_open_end(chat, chat_template) if continue_final_message else None
        out = compiled.render(messages=chat, tools=tools, documents=documents,
                              add_generation_prompt=add_generation_prompt, **template_kwargs)
        rendered.append(out if text is None else _cut_at_open_end(out, text))
    return rendered


def _version_tuple(v: str) -> tuple:
    parts = []
    for p in v.split(".")[:3]:
        digits = "".join(c for c in p if c.isdigit()) if not p.isdigit() else p
        parts.append(int(digits or 0))
        if not p.isdigit():
            break
    return tuple(parts)


@lru_cache
def _compile(chat_template: str):
    """transformers' _cached_compile_jinja_template: same sandbox, extensions, filters and globals."""
    import jinja2
    import jinja2.exceptions
    import jinja2.ext
    import jinja2.nodes
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if _version_tuple(jinja2.__version__) < (3, 1, 6):
        raise ImportError(f"apply_chat_template requires jinja2>=3.1.6 to be installed. Your version is "
                          f"{jinja2.__version__}. You can upgrade it with `pip install -U jinja2`.")

    class Generation(jinja2.ext.Extension):
        # {% generation %}...{% endgeneration %} marks assistant text for assistant masks; rendering
        # is the body unchanged (masks are not offered here)
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters; transformers' does not
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
                    "Please rename the attribute.")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(chat_template)
