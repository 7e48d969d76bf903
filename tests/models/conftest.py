"""Shared fixtures for the model tests: a minimal paged-batch runner standing in for the engine, tiny random
Hugging Face checkpoints, and the embedded model converted once per session."""

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from lockstep.layers.attention import flatten_batch
from lockstep.models.llama import LlamaForCausalLM


@dataclass
class PagedRunner:
    """Owns a paged KV cache for one model and runs flattened batches over it, like the engine would.

    Blocks are handed out from ``block_order`` (default: ascending), so a test can place a sequence's blocks
    anywhere in the pool.
    """

    model: LlamaForCausalLM
    num_blocks: int = 64
    block_size: int = 4
    block_order: list[int] | None = None
    tables: dict[str, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.kv_caches = self.model.allocate_kv_cache(self.num_blocks, self.block_size)
        self.free = list(self.block_order if self.block_order is not None else range(self.num_blocks))

    def _table(self, seq: str, num_tokens: int) -> list[int]:
        table = self.tables.setdefault(seq, [])
        while len(table) * self.block_size < num_tokens:
            table.append(self.free.pop(0))
        return table

    def forward(self, chunks: list[tuple[str, list[int], int]]) -> list[torch.Tensor]:
        """Run ``(seq_id, new_token_ids, start_position)`` chunks as one flattened batch, laid out by the engine's
        ``flatten_batch``. Returns each chunk's final hidden states, ``[len(new_token_ids), hidden_size]``.
        """
        layout = [(tokens, start, self._table(seq, start + len(tokens))) for seq, tokens, start in chunks]
        flat = flatten_batch(layout, self.block_size)
        hidden = self.model(*flat.to(self.model.device, self.kv_caches))
        starts = flat.query_start_loc
        return [hidden[starts[i] : starts[i + 1]] for i in range(len(chunks))]

    def prefill_logits(self, seq: str, tokens: list[int]) -> torch.Tensor:
        """fp32 logits at every position of one sequence prefilled alone: ``[len(tokens), vocab]``."""
        return self.model.compute_logits(self.forward([(seq, tokens, 0)])[0])

    def greedy(self, seq: str, prompt: list[int], max_new_tokens: int, stop: tuple[int, ...] = ()) -> list[int]:
        hidden = self.forward([(seq, prompt, 0)])[0][-1:]
        out: list[int] = []
        while len(out) < max_new_tokens:
            token = int(self.model.compute_logits(hidden).argmax(-1))
            out.append(token)
            if token in stop:
                break
            hidden = self.forward([(seq, [token], len(prompt) + len(out) - 1)])[0]
        return out


def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    """Give every parameter of an HF model non-trivial values (HF zeroes biases and sets norms to one)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(noise / p.shape[-1] ** 0.5)


TINY = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=80,  # not a multiple of 64: exercises the padded silu tile
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)


def save_tiny_hf(folder: Path, arch: str, seed: int = 0, max_shard_size: str | None = None, **overrides) -> Path:
    """Save a tiny random-weight HF checkpoint of ``arch`` ("llama", "qwen2", "qwen3") to ``folder``."""
    import transformers

    cls_config, cls_model = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[arch]
    kwargs = dict(TINY)
    if arch == "qwen3":
        kwargs["head_dim"] = 32  # Qwen3 decouples head_dim from hidden_size / heads
    kwargs.update(overrides)
    config = cls_config(**kwargs)
    torch.manual_seed(seed)
    model = cls_model(config).float().eval()
    randomize_(model, seed)
    save_kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **save_kwargs)
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


@pytest.fixture(scope="session")
def smollm_tokenizer(embedded_model_dir: Path):
    from lockstep.models.loader import load_tokenizer

    return load_tokenizer(embedded_model_dir)


@pytest.fixture(scope="session")
def chat_prompt(smollm_tokenizer) -> list[int]:
    """A real prompt through SmolLM2's chat template."""
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = smollm_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
