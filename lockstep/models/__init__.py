"""Model definitions and checkpoint loading. One implementation serves the whole Llama family."""

from lockstep.models.embedded import default_model_path
from lockstep.models.llama import SUPPORTED_ARCHITECTURES, LlamaForCausalLM, ModelConfig
from lockstep.models.loader import load_model, load_tokenizer, read_config

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "LlamaForCausalLM",
    "ModelConfig",
    "default_model_path",
    "load_model",
    "load_tokenizer",
    "read_config",
]
