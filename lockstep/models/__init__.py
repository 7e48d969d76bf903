"""Model definitions and checkpoint loading. One implementation serves the whole Llama family (llama.py); the
vision-language models build on it (qwen3_vl.py, qwen2_5_vl.py, vlm.py)."""

from lockstep.models.embedded import default_model_path
from lockstep.models.llama import SUPPORTED_ARCHITECTURES, LlamaForCausalLM, ModelConfig
from lockstep.models.loader import load_model, load_tokenizer, model_class, read_config
from lockstep.models.multimodal import ImageFeatures, MultimodalBatch, MultimodalConfig

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "LlamaForCausalLM",
    "ModelConfig",
    "ImageFeatures",
    "MultimodalBatch",
    "MultimodalConfig",
    "default_model_path",
    "load_model",
    "load_tokenizer",
    "model_class",
    "read_config",
]
