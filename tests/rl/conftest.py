"""Fixtures for the RL tests: the tiny random Llama folder of tests/engine (loaded from there by path)."""

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("engine_fixtures", Path(__file__).parents[1] / "engine" / "conftest.py")
engine_fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(engine_fixtures)


@pytest.fixture(scope="session")
def tiny_rl_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return engine_fixtures.save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-rl"))


@pytest.fixture(scope="session")
def tiny_rl_model_dir_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same architecture with other random weights."""
    return engine_fixtures.save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-rl-b"), seed=1)
