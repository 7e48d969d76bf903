"""Tiny random-weight Llama checkpoints with a one-token-per-character tokenizer, for fast tests."""

import string
from pathlib import Path

import torch

TINY_CHARS = string.printable[:95]  # digits, letters, punctuation, space: 95 tokens, then <unk> and </s>
TINY_VOCAB = len(TINY_CHARS) + 2
TINY_EOS = TINY_VOCAB - 1


def save_char_tokenizer(folder: Path) -> None:
    """A tokenizer with one token per printable ASCII character, ``<unk>`` = 95, ``</s>`` = 96 (EOS)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(TINY_CHARS)} | {"<unk>": TINY_VOCAB - 2, "</s>": TINY_EOS}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")
    fast.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    fast.save_pretrained(folder)


def save_tiny_llama(folder: Path, seed: int = 0, **overrides) -> Path:
    """A tiny random-weight Llama checkpoint (vocab 97, 2 layers, hidden 64, GQA 4/2) plus the char tokenizer."""
    import transformers

    kwargs = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=TINY_EOS,
        pad_token_id=None,
    )
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kwargs)).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            # Large weights give a peaked distribution: greedy and sampled runs see real structure.
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 2.0 * noise / p.shape[-1] ** 0.5)
    model.save_pretrained(folder)
    save_char_tokenizer(folder)
    return folder
