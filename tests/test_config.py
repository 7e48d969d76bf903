"""EngineConfig: validated when built, each bad field named with its value."""

import pytest

from lockstep.config import EngineConfig


def test_config_validation():
    with pytest.raises(ValueError, match="max_num_seqs must be an int >= 1, got 0"):
        EngineConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="block_size must be a power of two, got 12"):
        EngineConfig(block_size=12)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(8\) must be >= max_num_seqs \(16\)"):
        EngineConfig(max_num_seqs=16, max_num_batched_tokens=8)
    with pytest.raises(ValueError, match="cannot hold one sequence of max_model_len=100"):
        EngineConfig(block_size=16, num_kv_blocks=6, max_model_len=100)
    EngineConfig(block_size=16, num_kv_blocks=7, max_model_len=100)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=0)
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="fp8")
    with pytest.raises(ValueError, match="enable_prefix_caching must be a bool"):
        EngineConfig(enable_prefix_caching="yes")
    with pytest.raises(ValueError, match=r"load_format must be one of \('auto', 'safetensors', 'dummy'\), got 'pt'"):
        EngineConfig(load_format="pt")


def test_kernels_and_batch_invariant_resolve_to_one_kernel_set():
    # batch_invariant is the shorthand for a kernel set; after construction both fields are set and agree.
    for kwargs, expected in [
        ({}, ("invariant", True)),
        ({"batch_invariant": True}, ("invariant", True)),
        ({"batch_invariant": False}, ("default", False)),
        ({"kernels": "torch-linear"}, ("torch-linear", False)),
        ({"kernels": "invariant", "batch_invariant": True}, ("invariant", True)),
    ]:
        config = EngineConfig(**kwargs)
        assert (config.kernels, config.batch_invariant) == expected, kwargs
    with pytest.raises(ValueError, match="batch_invariant=True contradicts kernels='default'"):
        EngineConfig(kernels="default", batch_invariant=True)
    with pytest.raises(ValueError, match="unknown kernel set 'fast'; registered: .*invariant"):
        EngineConfig(kernels="fast")
    with pytest.raises(ValueError, match="batch_invariant must be a bool"):
        EngineConfig(batch_invariant=1)


def test_tensor_parallel_size_and_tp_invariant_resolve():
    # tp_invariant=None: the chunk tree exactly when TP > 1 on a batch-invariant kernel set.
    cases = [
        ({}, (1, False)),
        ({"tp_invariant": True}, (1, True)),
        ({"tensor_parallel_size": 2}, (2, True)),
        ({"tensor_parallel_size": 8, "tp_invariant": True}, (8, True)),
        ({"tensor_parallel_size": 4, "batch_invariant": False}, (4, False)),  # the fast mode: a plain all-reduce
        ({"tensor_parallel_size": 3, "batch_invariant": False}, (3, False)),  # no tree: any size the shapes allow
    ]
    for kwargs, expected in cases:
        config = EngineConfig(**kwargs)
        assert (config.tensor_parallel_size, config.tp_invariant) == expected, kwargs
    with pytest.raises(ValueError, match="tensor_parallel_size must be an int >= 1, got 0"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="tp_invariant must be a bool"):
        EngineConfig(tp_invariant="yes")
    with pytest.raises(ValueError, match="tensor-parallel sizes dividing 8"):
        EngineConfig(tensor_parallel_size=6)
    with pytest.raises(ValueError, match="would make results depend on the batch"):
        EngineConfig(tensor_parallel_size=2, tp_invariant=False)
    with pytest.raises(ValueError, match="tp_invariant=True needs a batch-invariant kernel set"):
        EngineConfig(batch_invariant=False, tp_invariant=True)


def test_vllm_batch_invariant_env_and_dtype_spellings(monkeypatch: pytest.MonkeyPatch) -> None:
    # vLLM's VLLM_BATCH_INVARIANT=0/1 is the shorthand's value when neither field is given; explicit fields win.
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")
    assert (EngineConfig().kernels, EngineConfig().batch_invariant) == ("default", False)
    assert EngineConfig(batch_invariant=True).kernels == "invariant"
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert EngineConfig().batch_invariant is True and EngineConfig(kernels="default").batch_invariant is False
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "yes")
    with pytest.raises(ValueError, match="VLLM_BATCH_INVARIANT must be 0 or 1"):
        EngineConfig()
    monkeypatch.delenv("VLLM_BATCH_INVARIANT")
    assert EngineConfig().batch_invariant is True  # lockstep's default
    assert EngineConfig(dtype="half").dtype == "float16" and EngineConfig(dtype="float").dtype == "float32"
