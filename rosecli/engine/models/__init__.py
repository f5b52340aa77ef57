"""Our own model implementations, chosen by the Hugging Face config's ``model_type``."""

from rosecli.engine.errors import ModelLoadError
from rosecli.engine.models.gpt2 import GPT2ForCausalLM
from rosecli.engine.models.llama import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

MODEL_CLASSES = {
    "gpt2": GPT2ForCausalLM,
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
}


def model_class(hf_config):
    cls = MODEL_CLASSES.get(getattr(hf_config, "model_type", None))
    if cls is None:
        raise ModelLoadError(f"model type {getattr(hf_config, 'model_type', None)!r} is not supported; "
                             f"supported: {', '.join(sorted(MODEL_CLASSES))}")
    return cls
