"""Programmatic dependent launch is GPU-only: the interpreter and the CPU never take it, whatever LOCKSTEP_PDL
says (the kernels' PDL variants are compiled for sm_90 in test_hopper_compile.py)."""

import torch

from lockstep.ops._common import PDL_ENV, pdl_launch, use_pdl


def test_off_the_gpu(monkeypatch):
    x = torch.zeros(2)
    monkeypatch.delenv(PDL_ENV, raising=False)
    assert not use_pdl(x) and pdl_launch(x) == {"USE_PDL": False}
    monkeypatch.setenv(PDL_ENV, "1")
    assert not use_pdl(x) and pdl_launch(x) == {"USE_PDL": False}  # a CPU tensor (and the interpreter)
