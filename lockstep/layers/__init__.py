"""Model building blocks. Each calls its arithmetic through a ``Kernels`` set (kernels.py)."""
