import os

# OpenMP threads that spin while waiting slow everything down when the 2 cores are shared; set before torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from tiny_models import save_tiny_llama, save_tiny_moe  # noqa: E402

# Without a GPU, Triton kernels run through the interpreter on CPU tensors. This must be set before any
# lockstep kernel module is imported (triton.jit reads it at decoration time).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama folder (vocab 97, 2 layers) with the character tokenizer."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session", params=["qwen3_moe", "mixtral"])
def tiny_moe_dir(request, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random mixture of experts (Qwen3-MoE: top 3 of 8, a dense layer among sparse ones; Mixtral: top 2
    of 4) with the character tokenizer, once per architecture."""
    return save_tiny_moe(tmp_path_factory.mktemp(f"tiny-{request.param}"), request.param)


def embedded_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    """$LOCKSTEP_CACHE when set, else one folder in the session's temp dir (never the user's cache)."""
    return os.environ.get("LOCKSTEP_CACHE") or str(tmp_path_factory.getbasetemp() / "lockstep-cache")


@pytest.fixture(scope="session")
def embedded_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded SmolLM2 folder, converted once per session (every test that needs it shares it)."""
    from lockstep.models import embedded

    mp = pytest.MonkeyPatch()
    mp.setenv("LOCKSTEP_CACHE", embedded_cache(tmp_path_factory))
    try:
        return embedded.default_model_path()
    finally:
        mp.undo()
