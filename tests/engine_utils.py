"""Tiny random models and engines for tests: built in-process, no files, CPU."""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from rosecli.engine.config import EngineConfig
from rosecli.engine.models import model_class
from rosecli.engine.runner import ModelRunner
from rosecli.engine.scheduler import Scheduler

VOCAB = 256


def tiny_hf_model(kind: str, seed: int = 0, vocab: int = VOCAB):
    torch.manual_seed(seed)
    if kind == "gpt2":
        cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=vocab, n_positions=256,
                         bos_token_id=0, eos_token_id=1)
        return GPT2LMHeadModel(cfg).eval()
    if kind == "llama":
        cfg = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=128, vocab_size=vocab, max_position_embeddings=256,
                          tie_word_embeddings=True, rope_theta=100000.0, bos_token_id=0, eos_token_id=1)
        return LlamaForCausalLM(cfg).eval()
    if kind == "qwen2":
        cfg = Qwen2Config(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=128, vocab_size=vocab, max_position_embeddings=256,
                          tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
        return Qwen2ForCausalLM(cfg).eval()
    raise ValueError(kind)


def our_model(hf_model):
    model = model_class(hf_model.config)(hf_model.config).eval()
    model.load_weights(hf_model.state_dict().items())
    return model


def tiny_scheduler(hf_model, eos=(1,), **config_kw) -> Scheduler:
    config_kw.setdefault("device", "cpu")
    config = EngineConfig(**config_kw).resolved("cpu")
    model = our_model(hf_model)
    max_len = hf_model.config.max_position_embeddings
    runner = ModelRunner(config, model, max_len, torch.device("cpu"), torch.float32)
    return Scheduler(config, runner, list(eos), max_len)


def hf_greedy(hf_model, prompt: list[int], n: int) -> list[int]:
    """Reference: Hugging Face greedy decoding of one prompt, alone, no EOS stop."""
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def rel_err(a, b) -> float:
    """Relative error of ``a`` against ``b`` (Frobenius norms, in float64)."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def same_greedy(a, ref, tol: float = 1e-3) -> bool:
    """Whether each row's greedy token under logits ``a`` is ``ref``'s, or ties with it within ``tol`` of the row's
    largest |logit| (a near tie that rounding alone can flip: random tiny models have some)."""
    a, ref = a.double(), ref.double()
    pick, best = a.argmax(-1, keepdim=True), ref.max(-1, keepdim=True).values
    gap = best - ref.gather(-1, pick)
    return bool((gap <= tol * ref.abs().max(-1, keepdim=True).values).all())
