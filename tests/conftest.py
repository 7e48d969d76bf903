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


def _row_independent_dot() -> None:
    """Make the interpreter's ``tl.dot`` give each output element the same bits whatever the tile's M and N, as a
    GPU's MMA does (each element's products summed by the same instructions in every tile shape).

    The interpreter computes a dot as ``np.matmul``, whose BLAS picks its kernel, and with it the summation order,
    from the matrix shape on some CPUs: on this project's 2-core machine (OpenBLAS 0.3.31 with its Haswell kernels)
    rows 0-15 of a [64, 128] x [128, 64] product had other bits than the same rows of a [32, 128] x [128, 16] one.
    Every invariance test of a kernel under the interpreter would then see the host's BLAS, not the kernel. Here a
    float dot sums its K products in float64 (each product of two fp32 values is exact there) by a pairwise tree
    fixed by K alone, and rounds once to the accumulator's dtype."""
    import numpy as np
    from triton.runtime import interpreter

    blas_dot = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if d.data.dtype not in (np.float32, np.float64):
            return blas_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        a_data, b_data = a.data, b.data
        if a.dtype.primitive_bitwidth == 8 and a.dtype.is_floating():  # e4m3/e5m2 operands: their values, exactly
            a_data = interpreter._convert_float(a_data, a.dtype, interpreter.tl.float16, None).view(np.float16)
        if b.dtype.primitive_bitwidth == 8 and b.dtype.is_floating():
            b_data = interpreter._convert_float(b_data, b.dtype, interpreter.tl.float16, None).view(np.float16)
        # [..., M, K, N] products, summed over K by a pairwise tree fixed by K alone
        terms = a_data.astype(np.float64)[..., :, :, None] * b_data.astype(np.float64)[..., None, :, :]
        while terms.shape[-2] > 1:
            if terms.shape[-2] % 2:
                terms = np.concatenate([terms, np.zeros_like(terms[..., :1, :])], axis=-2)
            terms = terms[..., 0::2, :] + terms[..., 1::2, :]
        return interpreter.TensorHandle(terms[..., 0, :].astype(d.data.dtype) + d.data, d.dtype.scalar)

    interpreter.InterpreterBuilder.create_dot = create_dot


if os.environ.get("TRITON_INTERPRET") == "1":
    _row_independent_dot()


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
