import os

# OpenMP threads that spin while waiting slow everything down when the 2 cores are shared; set before torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

# Without a GPU, Triton kernels run through the interpreter on CPU tensors. This must be set before any
# lockstep kernel module is imported (triton.jit reads it at decoration time).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
