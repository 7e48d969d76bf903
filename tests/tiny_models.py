"""Tiny random-weight Hugging Face checkpoints (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral), a
one-token-per-character tokenizer, and transformers' logits to compare against, for fast tests."""

import string
from pathlib import Path

import torch

TINY_CHARS = string.printable[:95]  # digits, letters, punctuation, space: 95 tokens, then <unk> and </s>
TINY_VOCAB = len(TINY_CHARS) + 2
TINY_EOS = TINY_VOCAB - 1

TINY = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=64,
    intermediate_size=80,  # not a multiple of 64: exercises the padded silu tile
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)

# Llama 3.1's rope scaling (its config.json values).
LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=500000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)


def save_char_tokenizer(folder: Path, chars: str = TINY_CHARS) -> None:
    """A tokenizer with one token per printable ASCII character, ``<unk>`` = 95, ``</s>`` = 96 (EOS); ``chars``:
    the characters in id order (a permutation of ``TINY_CHARS`` gives another tokenizer of the same size)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(chars)} | {"<unk>": TINY_VOCAB - 2, "</s>": TINY_EOS}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")
    fast.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    fast.save_pretrained(folder)


def randomize_(model: torch.nn.Module, seed: int = 0, scale: float = 1.0) -> None:
    """Give every parameter of an HF model non-trivial values (HF zeroes biases and sets norms to one): norms
    near one, biases small, matrices ``scale`` times unit-variance outputs."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(scale * noise / p.shape[-1] ** 0.5)


# The mixtures of experts: 8 experts (Qwen3-MoE: 24 wide, top 3, renormalised; layer 1 of 3 dense through
# mlp_only_layers) and Mixtral (4 experts of intermediate_size, top 2).
TINY_QWEN3_MOE = dict(
    num_hidden_layers=3,
    head_dim=32,
    num_experts=8,
    num_experts_per_tok=3,
    moe_intermediate_size=24,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[1],
)
TINY_MIXTRAL = dict(num_local_experts=4, num_experts_per_tok=2)


def save_tiny_hf(
    folder: Path, arch: str, seed: int = 0, max_shard_size: str | None = None, scale: float = 1.0, **overrides
) -> Path:
    """Save a tiny random-weight HF checkpoint of ``arch`` ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe",
    "mixtral") to ``folder``."""
    import transformers

    cls_config, cls_model = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
    }[arch]
    kwargs = dict(TINY)
    if arch == "qwen3":
        kwargs["head_dim"] = 32  # Qwen3 decouples head_dim from hidden_size / heads
    kwargs.update({"qwen3_moe": TINY_QWEN3_MOE, "mixtral": TINY_MIXTRAL}.get(arch, {}))
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = cls_model(cls_config(**kwargs)).float().eval()
    randomize_(model, seed, scale)
    save_kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **save_kwargs)
    return folder


def save_tiny_llama(folder: Path, seed: int = 0, **overrides) -> Path:
    """A tiny random-weight Llama checkpoint (vocab 97, 2 layers, hidden 64, GQA 4/2) plus the char tokenizer."""
    kwargs = dict(bos_token_id=None, eos_token_id=TINY_EOS, pad_token_id=None) | overrides
    # Large weights give a peaked distribution: greedy and sampled runs see real structure.
    save_tiny_hf(folder, "llama", seed, scale=2.0, **kwargs)
    save_char_tokenizer(folder)
    return folder


def save_tiny_moe(folder: Path, arch: str = "qwen3_moe", seed: int = 0, **overrides) -> Path:
    """A tiny random-weight mixture of experts ("qwen3_moe" or "mixtral") plus the char tokenizer, peaked like
    ``save_tiny_llama``'s."""
    kwargs = dict(bos_token_id=None, eos_token_id=TINY_EOS, pad_token_id=None) | overrides
    save_tiny_hf(folder, arch, seed, scale=2.0, **kwargs)
    save_char_tokenizer(folder)
    return folder


def hf_logits(folder: Path, tokens: list[int]) -> torch.Tensor:
    """Hugging Face transformers' fp32 logits for one sequence: ``[len(tokens), vocab]``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def max_rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest absolute difference, relative to the reference's largest magnitude."""
    return ((ours.double() - ref.double()).abs().max() / ref.double().abs().max()).item()
