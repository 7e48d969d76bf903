import os

# OpenMP threads that spin while waiting slow everything down when the 2 cores are shared; set before torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from tiny_models import save_tiny_llama  # noqa: E402

# Without a GPU, Triton kernels run through the interpreter on CPU tensors. This must be set before any
# lockstep kernel module is imported (triton.jit reads it at decoration time).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama folder (vocab 97, 2 layers) with the character tokenizer."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


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
