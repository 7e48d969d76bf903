"""Fixtures for the RL tests: a second tiny random Llama folder, the shared one's architecture with other weights."""

from pathlib import Path

import pytest
from tiny_models import save_tiny_llama


@pytest.fixture(scope="session")
def tiny_rl_model_dir_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same architecture with other random weights."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-rl-b"), seed=1)
