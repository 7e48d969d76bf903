"""Fixtures for the model tests: the embedded SmolLM2's tokenizer and a real chat prompt through it."""

from pathlib import Path

import pytest


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
