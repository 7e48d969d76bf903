"""Rotary embedding frequencies: the same bits as transformers' rope initialisers, scaled and not."""

import torch
from tiny_models import LLAMA3_ROPE

from lockstep.layers.rotary import inverse_frequencies


def test_rope_frequencies_match_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for params in (LLAMA3_ROPE, dict(rope_type="linear", rope_theta=10000.0, factor=4.0)):
        hf_config = LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_parameters=dict(params))
        expected, _ = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf_config)
        ours = inverse_frequencies(128, params["rope_theta"], params)
        assert torch.equal(ours, expected)
