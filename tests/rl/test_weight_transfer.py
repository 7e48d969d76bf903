"""Weight updates over torch.distributed (gloo): a trainer's broadcast in buckets changes the sampler's answers
exactly as ``LLM.load_weights`` of the same tensors does, at TP 1 and at TP 2 (the worker joins the group too), and
the prefix cache is invalidated on the way (a stale hit would give the old weights' bits). Also a sharded trainer
(DTensor parameters over its own gloo group) gathering per bucket."""

import socket
import threading

import pytest
import torch

from lockstep import LLM, SamplingParams
from lockstep.distributed.weight_group import TensorSpec, buckets, pack, unpack
from lockstep.models.loader import load_model
from lockstep.rl.weight_sync import WeightSender

PROMPTS = [[(3 * i + j) % 95 for j in range(20 + i)] for i in range(3)]  # > one block: prefix-cache hits
PARAMS = [SamplingParams(temperature=0.9, seed=7 + i, max_tokens=6) for i in range(3)]


def _bits(outs):
    return [(o.outputs[0].token_ids, o.outputs[0].token_logprobs) for o in outs]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _in_thread(fn):
    """Run ``fn`` in a thread (the trainer's side of a collective); returns a join that re-raises its error."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised by the join
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()

    def join():
        t.join(120)
        assert not t.is_alive(), "the trainer's side did not finish"
        if "error" in box:
            raise box["error"]
        return box.get("value")

    return join


def _connect(llm: LLM, num_ranks: int, **sender_kwargs) -> WeightSender:
    port = free_port()
    world = 1 + num_ranks
    join = _in_thread(lambda: WeightSender.connect("127.0.0.1", port, world, "cpu", **sender_kwargs))
    llm.init_weight_transfer_engine(
        {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": world}
    )
    return join()


def _update(llm: LLM, sender: WeightSender, named: list) -> list[str]:
    join = _in_thread(lambda: sender.send(named))
    loaded = llm.update_weights(sender.update_info(named))
    join()
    return loaded


def test_buckets_cut_the_same_way_and_round_trip():
    specs = [TensorSpec(f"t{i}", dt, shape) for i, (dt, shape) in enumerate(
        [(torch.float32, (3, 5)), (torch.bfloat16, (7,)), (torch.float32, (100,)), (torch.float16, (1,))])]  # fmt: skip
    plan = buckets(specs, 64)
    assert [[s.name for s in b.specs] for b in plan] == [["t0"], ["t1"], ["t2"], ["t3"]]  # 60 B, 14 B, 400 B: alone
    plan = buckets(specs, 100)
    assert [[s.name for s in b.specs] for b in plan] == [["t0", "t1"], ["t2"], ["t3"]]
    assert plan[0].offsets == (0, 64)  # 16-byte aligned
    tensors = [torch.randn(s.shape).to(s.dtype) for s in specs]
    buffer = torch.empty(max(b.nbytes for b in plan), dtype=torch.uint8)
    at = 0
    for b in plan:
        pack(b, tensors[at : at + len(b.specs)], buffer)
        for (name, got), want in zip(unpack(b, buffer), tensors[at : at + len(b.specs)], strict=True):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name
        at += len(b.specs)


@pytest.mark.parametrize("bucket_bytes", [4096, 64 << 20])  # many buckets (tensors larger than one too), and one
def test_update_over_gloo_equals_load_weights(tiny_model_dir, tiny_rl_model_dir_b, bucket_bytes):
    sampler = LLM(str(tiny_model_dir), max_num_batched_tokens=32, max_num_seqs=2)
    reference = LLM(str(tiny_model_dir), max_num_batched_tokens=32, max_num_seqs=2)
    before = sampler.generate(PROMPTS, PARAMS, use_tqdm=False)  # fills the prefix cache with the old weights' K/V
    reference.generate(PROMPTS, PARAMS, use_tqdm=False)
    sender = _connect(sampler, 1, bucket_bytes=bucket_bytes)
    new = list(load_model(tiny_rl_model_dir_b).checkpoint_tensors().items())
    loaded = _update(sampler, sender, new)
    assert "model.layers.0.self_attn.q_proj.weight" in loaded
    assert sorted(loaded) == sorted(reference.load_weights(dict(new)))
    after = sampler.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert _bits(after) == _bits(reference.generate(PROMPTS, PARAMS, use_tqdm=False))
    assert _bits(after) != _bits(before)  # negative control: the update did change the answers
    # The prefix cache was invalidated: a fresh engine on the new weights gives the same bits.
    fresh = LLM(str(tiny_rl_model_dir_b), max_num_batched_tokens=32, max_num_seqs=2)
    assert _bits(after) == _bits(fresh.generate(PROMPTS, PARAMS, use_tqdm=False))
    # A second update on the same group (back to the first weights), sent as bf16 -> fp32 would round: fp32 here.
    _update(sampler, sender, list(load_model(tiny_model_dir).checkpoint_tensors().items()))
    assert _bits(sampler.generate(PROMPTS, PARAMS, use_tqdm=False)) == _bits(before)
    sender.close()


def test_stale_prefix_hit_would_show(tiny_model_dir, tiny_rl_model_dir_b):
    """The harness sees a stale prefix cache: update the weights but put the old cache entries back, and the
    answers of prompts hitting them differ from a fresh engine's (so the automatic reset is what the test above
    relies on)."""
    sampler = LLM(str(tiny_model_dir), max_num_batched_tokens=32, max_num_seqs=2)
    sampler.generate(PROMPTS, PARAMS, use_tqdm=False)
    blocks = sampler.engine.scheduler.block_manager
    saved = dict(blocks.hash_to_block_id), [b.hash for b in blocks.blocks]
    sender = _connect(sampler, 1)
    _update(sampler, sender, list(load_model(tiny_rl_model_dir_b).checkpoint_tensors().items()))
    sender.close()
    blocks.hash_to_block_id.update(saved[0])
    for b, h in zip(blocks.blocks, saved[1], strict=True):
        b.hash = h
    stale = sampler.generate(PROMPTS, PARAMS, use_tqdm=False)
    fresh = LLM(str(tiny_rl_model_dir_b), max_num_batched_tokens=32, max_num_seqs=2)
    assert _bits(stale) != _bits(fresh.generate(PROMPTS, PARAMS, use_tqdm=False))


def test_update_errors(tiny_model_dir):
    sampler = LLM(str(tiny_model_dir))
    with pytest.raises(RuntimeError, match="init_weight_transfer_engine"):
        sampler.update_weights({"names": [], "dtype_names": [], "shapes": []})
    with pytest.raises(ValueError, match="rank_offset"):
        sampler.init_weight_transfer_engine(
            {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 1}
        )
    sender = _connect(sampler, 1)
    bad = {"names": ["model.nope.weight"], "dtype_names": ["float32"], "shapes": [[2]]}
    with pytest.raises(ValueError, match="unexpected tensor"):
        sampler.update_weights(bad)  # refused before any byte moves: the trainer never sends
    with pytest.raises(ValueError, match="shape"):
        sampler.update_weights({"names": ["model.norm.weight"], "dtype_names": ["float32"], "shapes": [[3]]})
    sender.close()


def test_tp2_sampler_every_rank_receives(tiny_model_dir, tiny_rl_model_dir_b):
    """The TP worker joins the group as rank 2 and takes its slices straight from the trainer's buckets."""
    new = list(load_model(tiny_rl_model_dir_b).checkpoint_tensors().items())
    with LLM(str(tiny_model_dir), tensor_parallel_size=2, max_num_batched_tokens=32, max_num_seqs=2) as sampler:
        sender = _connect(sampler, 2, bucket_bytes=8192)
        _update(sampler, sender, new)
        after = sampler.generate(PROMPTS, PARAMS, use_tqdm=False)
        sampler.load_weights(dict(new))  # the reference path: rank 0 broadcasts over the TP group
        assert _bits(after) == _bits(sampler.generate(PROMPTS, PARAMS, use_tqdm=False))
        sampler.load_weights(load_model(tiny_model_dir).checkpoint_tensors())
        assert _bits(sampler.generate(PROMPTS, PARAMS, use_tqdm=False)) != _bits(after)  # negative control
        sender.close()


def _fsdp_trainer(group, model_dir: str, port: int, world: int, bucket_bytes: int) -> list[str]:
    """A trainer rank of an FSDP2 (``fully_shard``) transformers model over the trainer's own gloo group: every
    rank gathers each bucket (DTensor.full_tensor), rank 0 broadcasts it to the sampler."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    from lockstep.rl.weight_sync import send_sharded

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (group.size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    named = list(model.named_parameters())
    assert all(isinstance(p, DTensor) for _, p in named)
    assert any(p.to_local().shape != p.shape for _, p in named)  # really sharded
    sender = WeightSender.connect("127.0.0.1", port, world, "cpu", bucket_bytes) if group.rank == 0 else None
    send_sharded(sender, named, bucket_bytes)
    if sender is not None:
        sender.close()
    return [name for name, _ in named]


def test_fsdp2_trainer_gathers_per_bucket(tiny_model_dir, tiny_rl_model_dir_b):
    from tp_spawn import run_ranks
    from transformers import AutoModelForCausalLM

    hf = dict(AutoModelForCausalLM.from_pretrained(tiny_rl_model_dir_b, dtype=torch.float32).named_parameters())
    info = {"names": list(hf), "dtype_names": ["float32"] * len(hf), "shapes": [list(t.shape) for t in hf.values()],
            "bucket_bytes": 16384}  # fmt: skip
    sampler = LLM(str(tiny_model_dir), max_num_batched_tokens=32, max_num_seqs=2)
    before = sampler.generate(PROMPTS, PARAMS, use_tqdm=False)
    port = free_port()
    join = _in_thread(lambda: run_ranks(_fsdp_trainer, 2, str(tiny_rl_model_dir_b), port, 2, 16384, timeout=240))
    sampler.init_weight_transfer_engine(
        {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2}
    )
    sampler.update_weights(info)
    names = join()
    assert names[0] == list(hf)  # the order update_info announced
    after = sampler.generate(PROMPTS, PARAMS, use_tqdm=False)
    reference = LLM(str(tiny_model_dir), max_num_batched_tokens=32, max_num_seqs=2)
    reference.load_weights({n: t.detach() for n, t in hf.items()})
    assert _bits(after) == _bits(reference.generate(PROMPTS, PARAMS, use_tqdm=False))
    assert _bits(after) != _bits(before)
