import os

import torch

# Without a GPU, Triton kernels run through the interpreter on CPU tensors. This must be set before any
# lockstep kernel module is imported (triton.jit reads it at decoration time).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
