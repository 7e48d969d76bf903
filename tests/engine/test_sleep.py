"""Sleep mode: ``LLM.sleep(level)`` releases the KV cache's storage and (level 1: offloaded, level 2: discarded) the
weights'; ``wake_up`` gives the same bits as before sleeping; level 2 needs every weight loaded before waking; a
sleeping engine refuses requests, queueing nothing. At TP 2 the worker sleeps and wakes with rank 0."""

import pytest
from tiny_models import save_tiny_llama

from lockstep import LLM, SamplingParams
from lockstep.models.loader import load_model

PROMPTS = [[(5 * i + j) % 95 for j in range(18 + 3 * i)] for i in range(3)]
PARAMS = [SamplingParams(temperature=0.8, seed=3 + i, max_tokens=6, logprobs=2) for i in range(3)]


def _bits(outs):
    return [(o.outputs[0].token_ids, o.outputs[0].token_logprobs) for o in outs]


def _weight_bytes(llm: LLM) -> int:
    seen = {}
    for t in llm.engine.runner.model.parameters():
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()  # stacked tensors share one storage
    return sum(seen.values())


def _kv_bytes(llm: LLM) -> int:
    return sum(t.untyped_storage().nbytes() for kv in llm.engine.runner.kv_caches for t in kv)


@pytest.fixture(scope="module")
def other_weights_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-sleep-b"), seed=1)


@pytest.fixture(scope="module")
def sleepy(tiny_model_dir):
    return LLM(str(tiny_model_dir), enable_sleep_mode=True, max_num_batched_tokens=32, max_num_seqs=2)


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_and_wake_up_gives_the_same_bits(sleepy, tiny_model_dir, level):
    before = sleepy.generate(PROMPTS, PARAMS, use_tqdm=False)
    weights, kv = _weight_bytes(sleepy), _kv_bytes(sleepy)
    assert weights > 0 and kv > 0
    sleepy.sleep(level=level)
    assert sleepy.is_sleeping
    assert _kv_bytes(sleepy) == 0  # the cache's storage is released
    assert _weight_bytes(sleepy) == 0  # level 1: offloaded to the host copy; level 2: gone
    assert sleepy.engine.scheduler.block_manager.hash_to_block_id == {}
    with pytest.raises(RuntimeError, match="sleeping"):
        sleepy.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert not sleepy.engine.has_unfinished_requests()  # nothing was queued
    if level == 2:
        with pytest.raises(ValueError, match="not loaded"):
            sleepy.wake_up()
        assert sleepy.is_sleeping
        sleepy.load_weights(load_model(tiny_model_dir).checkpoint_tensors())  # the trainer's weights, say
    sleepy.wake_up()
    assert not sleepy.is_sleeping
    assert (_weight_bytes(sleepy), _kv_bytes(sleepy)) == (weights, kv)
    assert _bits(sleepy.generate(PROMPTS, PARAMS, use_tqdm=False)) == _bits(before)


def test_level2_partial_load_is_refused_then_completed(sleepy, tiny_model_dir):
    before = sleepy.generate(PROMPTS, PARAMS, use_tqdm=False)
    sleepy.sleep(2)
    tensors = load_model(tiny_model_dir).checkpoint_tensors()
    names = sorted(tensors)
    sleepy.load_weights({n: tensors[n] for n in names[:3]})
    with pytest.raises(ValueError, match=f"{len(names) - 3} of them were not loaded"):
        sleepy.wake_up()
    sleepy.load_weights({n: tensors[n] for n in names[3:]})
    sleepy.wake_up(["weights"])  # one tag at a time, as vLLM's
    assert sleepy.is_sleeping and _kv_bytes(sleepy) == 0
    sleepy.wake_up(["kv_cache"])
    assert not sleepy.is_sleeping
    assert _bits(sleepy.generate(PROMPTS, PARAMS, use_tqdm=False)) == _bits(before)


def test_level1_load_while_asleep_keeps_the_other_weights(sleepy, tiny_model_dir, other_weights_dir):
    """A weight loaded while asleep at level 1 lands on its offloaded storage; the rest come back on wake-up:
    the answers are those of a fresh engine loaded with the same mix (and not those of before: negative control)."""
    before = sleepy.generate(PROMPTS, PARAMS, use_tqdm=False)
    other = load_model(other_weights_dir).checkpoint_tensors()
    mix = {n: t for n, t in other.items() if ".mlp." in n}
    sleepy.sleep(1)
    sleepy.load_weights(mix)
    sleepy.wake_up()
    after = sleepy.generate(PROMPTS, PARAMS, use_tqdm=False)
    reference = LLM(str(tiny_model_dir), max_num_batched_tokens=32, max_num_seqs=2)
    reference.load_weights(mix)
    assert _bits(after) == _bits(reference.generate(PROMPTS, PARAMS, use_tqdm=False))
    assert _bits(after) != _bits(before)
    sleepy.load_weights(load_model(tiny_model_dir).checkpoint_tensors())  # back, for the module's other tests


def test_sleep_errors(tiny_model_dir, sleepy):
    plain = LLM(str(tiny_model_dir))
    with pytest.raises(RuntimeError, match="enable_sleep_mode"):
        plain.sleep()
    with pytest.raises(ValueError, match="level"):
        sleepy.sleep(level=3)
    with pytest.raises(ValueError, match="tags"):
        sleepy.wake_up(["everything"])
    sleepy.engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="still running"):
        sleepy.sleep()
    sleepy.engine.abort("r")
    assert sleepy.reset_prefix_cache() is True  # idle: done
    sleepy.wake_up()  # awake already: nothing to do


def test_tp2_sleep_and_wake(tiny_model_dir):
    with LLM(str(tiny_model_dir), tensor_parallel_size=2, enable_sleep_mode=True, max_num_batched_tokens=32,
             max_num_seqs=2) as llm:  # fmt: skip
        before = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        llm.sleep(2)
        llm.load_weights(load_model(tiny_model_dir).checkpoint_tensors())  # every rank takes its slices
        llm.wake_up()
        assert _bits(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == _bits(before)
        llm.sleep(1)
        llm.wake_up()
        assert _bits(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == _bits(before)


def test_reset_prefix_cache_refused_while_running(tiny_model_dir):
    llm = LLM(str(tiny_model_dir))
    llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert llm.engine.scheduler.block_manager.hash_to_block_id
    llm.engine.add_request("r", PROMPTS[0], SamplingParams(max_tokens=4))
    llm.engine.step()
    assert llm.reset_prefix_cache() is False
    llm.engine.abort("r")
    assert llm.reset_prefix_cache() is True
    assert llm.engine.scheduler.block_manager.hash_to_block_id == {}
