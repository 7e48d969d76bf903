"""The engine's image bookkeeping without a model: a request's M-RoPE positions, the scheduler's encoder budget and
encoder cache, and prefix-cache keys that include the image's pixels."""

import torch

from lockstep.config import EngineConfig
from lockstep.engine import Scheduler, Sequence
from lockstep.engine.block_manager import hash_block
from lockstep.engine.multimodal import ImageInput, MultimodalInputs
from lockstep.sampling_params import SamplingParams

BS = 4
IMG = 90  # the image placeholder token id of these tests


class Features:
    """Stands in for ImageFeatures: what the runner would put in the cache."""

    def __init__(self, n: int) -> None:
        self.embeds = torch.zeros(n, 2)
        self.deepstack = None


def image(offset: int, num_tokens: int, tag: bytes = b"a") -> ImageInput:
    return ImageInput(torch.zeros(num_tokens * 4, 3), (1, 2, num_tokens * 2), offset, num_tokens, tag * 16)


def mm_seq(rid: str, before: list[int], images: list[tuple[int, bytes]], after: list[int], max_tokens=4) -> Sequence:
    """A prompt ``before + image tokens (+ 1 separator token each) + after``; positions as M-RoPE gives text (the
    exact values do not matter to the scheduler)."""
    ids = list(before)
    inputs = []
    for n, tag in images:
        inputs.append(image(len(ids), n, tag))
        ids += [IMG] * n + [1]
    ids += after
    positions = torch.arange(len(ids)).expand(3, -1).clone()
    mm = MultimodalInputs(tuple(inputs), positions, -3)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Sequence(rid, ids, params, block_size=BS, mm=mm)


def make_scheduler(**overrides) -> Scheduler:
    kwargs = dict(max_num_seqs=8, max_num_batched_tokens=64, block_size=BS, num_kv_blocks=64)
    kwargs.update(overrides)
    return Scheduler(EngineConfig(**kwargs), eos_token_ids=[0])


def run_step(sched: Scheduler):
    """One step as the engine runs it: encode what the batch asks (into the cache), then postprocess."""
    batch = sched.schedule()
    for e in batch.entries:
        for k in e.encode:
            assert (e.seq.request_id, k) not in sched.encoder_cache, "an image encoded twice"
            sched.encoder_cache.put(e.seq.request_id, k, Features(e.seq.mm.images[k].num_tokens))
        for k, _ in e.seq.mm.overlapping(e.start, e.end) if e.seq.mm else []:
            assert (e.seq.request_id, k) in sched.encoder_cache or k in e.encode, "a chunk reached an image unencoded"
    sched.postprocess(batch, [5] * batch.num_samples)
    sched.check_integrity()
    return batch


def test_positions_of_prompt_and_outputs() -> None:
    positions = torch.tensor([[0, 1, 1, 1, 3], [0, 1, 1, 2, 3], [0, 1, 2, 1, 3]])
    mm = MultimodalInputs((image(1, 3),), positions, -2)
    assert mm.positions_of(0, 5).tolist() == positions.tolist()
    # Past the prompt: index + delta in all three components; a range across the end takes both.
    assert mm.positions_of(3, 7).tolist() == [[1, 3, 3, 4], [2, 3, 3, 4], [1, 3, 3, 4]]
    assert mm.text_positions(4, 7) == [3, 3, 4]
    assert [k for k, _ in mm.overlapping(0, 1)] == [] and [k for k, _ in mm.overlapping(3, 9)] == [0]


def test_block_extra_only_for_blocks_with_image_tokens() -> None:
    mm = MultimodalInputs((image(6, 5, b"x"),), torch.zeros(3, 16, dtype=torch.int64), 0)
    assert mm.block_extra(0, BS) == b""  # tokens 0-3: text
    assert mm.block_extra(1, BS).startswith(b"x" * 16)  # tokens 4-7: image tokens 0-1
    assert mm.block_extra(2, BS) != mm.block_extra(1, BS)  # tokens 8-11: image tokens 2-4 (another offset)
    assert mm.block_extra(3, BS) == b""


def test_a_chunk_stops_before_an_image_the_encoder_budget_cannot_take() -> None:
    sched = make_scheduler(max_num_encoder_tokens_per_step=10)
    a = mm_seq("a", [2, 3, 4], [(8, b"a")], [6, 7])
    b = mm_seq("b", [2, 3, 4], [(8, b"b")], [6, 7])
    sched.add(a)
    sched.add(b)
    first = run_step(sched)
    assert [(e.seq.request_id, e.num_new_tokens, e.encode) for e in first.entries] == [("a", 14, (0,)), ("b", 3, ())]
    second = run_step(sched)
    # b's image now: a decodes, b's chunk goes through its image.
    assert [(e.seq.request_id, e.num_new_tokens, e.encode) for e in second.entries] == [("a", 1, ()), ("b", 11, (0,))]
    assert len(sched.encoder_cache) == 0  # both images' tokens are computed: their features are gone


def test_an_image_larger_than_the_budget_is_encoded_alone() -> None:
    sched = make_scheduler(max_num_encoder_tokens_per_step=4)
    small = mm_seq("small", [2], [(3, b"s")], [6])
    big = mm_seq("big", [2], [(12, b"b")], [6])
    sched.add(small)
    sched.add(big)
    first = run_step(sched)
    assert [(e.seq.request_id, e.num_new_tokens, e.encode) for e in first.entries] == [
        ("small", 6, (0,)),
        ("big", 1, ()),
    ]
    second = run_step(sched)  # nothing else encodes in this step: the big image goes, over the budget
    assert [(e.seq.request_id, e.encode) for e in second.entries] == [("small", ()), ("big", (0,))]


def test_chunked_prefill_through_an_image_encodes_it_once_and_keeps_it_until_its_end() -> None:
    sched = make_scheduler(max_num_batched_tokens=5, max_num_seqs=1)
    seq = mm_seq("a", [2, 3], [(9, b"a")], [6, 7, 8])
    sched.add(seq)
    encoded = []
    while seq.num_computed_tokens < seq.num_prompt_tokens:
        batch = run_step(sched)
        encoded += list(batch.entries[0].encode)
        still_needed = seq.num_computed_tokens < seq.mm.images[0].end
        assert (("a", 0) in sched.encoder_cache) == still_needed
    assert encoded == [0]


def test_preemption_and_abort_free_the_encoder_cache() -> None:
    # Two requests whose images are computed in chunks; a cache too small for both: one is preempted mid-prefill.
    sched = make_scheduler(max_num_batched_tokens=8, max_num_seqs=2, num_kv_blocks=8)
    a = mm_seq("a", [2], [(10, b"a")], [3], max_tokens=12)
    b = mm_seq("b", [2], [(10, b"b")], [3], max_tokens=12)
    sched.add(a)
    sched.add(b)
    preempted = []
    for _ in range(60):
        if not sched.has_unfinished():
            break
        batch = run_step(sched)
        preempted += batch.preempted
        for seq in batch.preempted:
            assert (seq.request_id, 0) not in sched.encoder_cache
    assert preempted and not sched.has_unfinished()
    assert len(sched.encoder_cache) == 0
    c = mm_seq("c", [2], [(10, b"c")], [3])
    sched.add(c)
    batch = sched.schedule()
    for e in batch.entries:
        for k in e.encode:
            sched.encoder_cache.put("c", k, Features(10))
    sched.abort("c")
    assert len(sched.encoder_cache) == 0


def test_the_same_image_in_several_requests_and_twice_in_one_is_encoded_once() -> None:
    # Three running requests show image "a" (one of them twice) and one shows "b": "a" is encoded by the first
    # chunk that reaches it, the others share its features; they go when the last request that needs them does.
    sched = make_scheduler(max_num_batched_tokens=64)
    seqs = [
        mm_seq("x", [2], [(6, b"a")], [3]),
        mm_seq("y", [4, 5], [(6, b"a"), (6, b"a")], [3]),  # other text, the image twice
        mm_seq("z", [2], [(6, b"b")], [3]),
        mm_seq("w", [2], [(4, b"a")], [3]),  # the same tag, another grid: another image
    ]
    for seq in seqs:
        sched.add(seq)
    first = run_step(sched)
    assert [(e.seq.request_id, e.encode) for e in first.entries] == [("x", (0,)), ("y", ()), ("z", (0,)), ("w", (0,))]
    cache = sched.encoder_cache
    assert (cache.encoded, cache.shared, len(cache)) == (3, 2, 0)  # every image's tokens were computed in one go
    # The second request alone, then the first again while it is still running: nothing is encoded again.
    sched = make_scheduler(max_num_batched_tokens=6, max_num_seqs=4)
    a = mm_seq("a", [2], [(8, b"a")], [3])
    sched.add(a)
    encodes = [run_step(sched).entries[0].encode]  # 6 of a's tokens: its image is cut, kept
    b = mm_seq("b", [2], [(8, b"a")], [3])
    sched.add(b)
    while sched.has_unfinished():
        encodes += [e.encode for e in run_step(sched).entries]
    assert [k for e in encodes for k in e] == [0] and sched.encoder_cache.encoded == 1
    assert len(sched.encoder_cache) == 0 and sched.encoder_cache.keys() == []


def test_encoder_cache_integrity_sees_a_miscounted_reference() -> None:
    """Negative control for the encoder cache's reference counts (check_integrity)."""
    import pytest

    sched = make_scheduler(max_num_batched_tokens=4, max_num_seqs=4)
    sched.add(mm_seq("a", [2], [(5, b"a")], [3], max_tokens=8))
    run_step(sched)  # a chunk that ends inside the image: its features are held
    sched.encoder_cache._users[next(iter(sched.encoder_cache._users))] += 1
    with pytest.raises(AssertionError, match="Encoder cache integrity"):
        sched.check_integrity()


def test_prefix_cache_keys_blocks_by_the_image_pixels() -> None:
    sched = make_scheduler()
    bm = sched.block_manager

    def finish(seq: Sequence) -> None:
        sched.add(seq)
        while not seq.is_finished:
            run_step(sched)

    finish(mm_seq("warm", [2, 3, 4, 5], [(8, b"a")], [6, 7, 8, 9, 10], max_tokens=1))
    same = mm_seq("same", [2, 3, 4, 5], [(8, b"a")], [11, 12, 13, 14, 15], max_tokens=1)  # same image, new question
    other = mm_seq("other", [2, 3, 4, 5], [(8, b"z")], [6, 7, 8, 9, 10], max_tokens=1)  # another image, same ids
    assert same.prompt_token_ids[:13] == other.prompt_token_ids[:13]
    hits_same, hits_other = bm._prefix_hits(same), bm._prefix_hits(other)
    assert len(hits_same) == 3  # the text block and the image's two blocks; block 3 holds the new question
    assert len(hits_other) == 1  # the text block only
    # A block of text alone hashes as a text-only request's block.
    text = Sequence("t", [2, 3, 4, 5, 1, 1, 1, 1], block_size=BS)
    assert bm.blocks[hits_other[0]].hash == hash_block(b"", text.block_token_ids(0))
    finish(same)
    finish(other)
    assert same.num_cached_tokens == 12 and other.num_cached_tokens == 4


def test_engine_config_checks_the_multimodal_fields() -> None:
    import pytest

    bad = [
        ({"limit_mm_per_prompt": {"video": 1}}, "limit_mm_per_prompt"),
        ({"limit_mm_per_prompt": {"image": -1}}, "limit_mm_per_prompt"),
        ({"mm_processor_kwargs": {"fps": 1}}, "mm_processor_kwargs takes min_pixels, max_pixels"),
        ({"mm_processor_kwargs": {"max_pixels": 0}}, "max_pixels"),
        ({"max_num_encoder_tokens_per_step": 0}, "max_num_encoder_tokens_per_step"),
        ({"max_image_pixels": 0}, "max_image_pixels"),
        ({"allowed_media_domains": "example.com"}, "allowed_media_domains"),
    ]
    for kwargs, words in bad:
        with pytest.raises(ValueError, match=words):
            EngineConfig(**kwargs)
    config = EngineConfig(limit_mm_per_prompt={"image": 0}, mm_processor_kwargs={"max_pixels": 4096})
    assert config.limit_mm_per_prompt == {"image": 0} and config.max_num_encoder_tokens_per_step is None


def test_random_image_workloads_keep_every_invariant() -> None:
    """Random image and text requests on small token, encoder and cache budgets (chunks through images,
    preemption): every chunk that reaches an image has it encoded (``run_step``), an image is encoded once per
    admission, the encoder cache never holds a finished or computed image (``check_integrity``), and everything
    is freed at the end."""
    import random

    preemptions = cut_images = 0
    for seed in range(6):
        rng = random.Random(seed)
        sched = make_scheduler(
            max_num_batched_tokens=rng.choice([8, 13, 32]),
            max_num_seqs=8,
            num_kv_blocks=rng.choice([24, 40]),
            max_num_encoder_tokens_per_step=rng.choice([3, 8, 100]),
            enable_prefix_caching=rng.random() < 0.5,
        )
        seqs = []
        for i in range(12):
            images = [(rng.randrange(1, 12), bytes([rng.randrange(4)])) for _ in range(rng.randrange(0, 3))]
            before = [rng.randrange(2, 50) for _ in range(rng.randrange(0, 6))]
            after = [rng.randrange(2, 50) for _ in range(rng.randrange(1, 6))]
            seq = mm_seq(str(i), before, images, after, max_tokens=rng.randrange(1, 10))
            if not images:
                seq = Sequence(str(i), before + after, seq.params, block_size=BS)
            sched.add(seq)
            seqs.append(seq)
        encodes: dict[tuple[str, int], int] = {}
        for _ in range(2000):
            if not sched.has_unfinished():
                break
            batch = run_step(sched)
            preemptions += len(batch.preempted)
            for e in batch.entries:
                mm = e.seq.mm
                cut_images += mm is not None and any(im.offset < e.end < im.end for im in mm.images)
                for k in e.encode:
                    encodes[(e.seq.request_id, k)] = encodes.get((e.seq.request_id, k), 0) + 1
        assert not sched.has_unfinished() and len(sched.encoder_cache) == 0
        for seq in seqs:
            for k in range(len(seq.mm.images) if seq.mm else 0):
                n = encodes.get((seq.request_id, k), 0)
                assert n <= seq.num_preemptions + 1
                # A prefix hit may cover a whole image, and another request with the same image may encode it.
                image = seq.mm.images[k]
                same = [s for s in seqs if s is not seq and s.mm and any(im.hash == image.hash and im.grid_thw ==
                        image.grid_thw for im in s.mm.images)]  # fmt: skip
                assert n >= 1 or sched.config.enable_prefix_caching or same
    assert preemptions and cut_images  # the workloads did preempt, and cut chunks inside images


def test_integrity_check_sees_a_leaked_image(monkeypatch) -> None:
    """Negative control for the checks above: features kept past their image's tokens are caught."""
    import pytest

    from lockstep.engine.encoder_cache import EncoderCache

    monkeypatch.setattr(EncoderCache, "free_computed", lambda self, seq: None)
    sched = make_scheduler()
    sched.add(mm_seq("a", [2], [(5, b"a")], [3]))
    with pytest.raises(AssertionError, match="encoder cache holds"):
        run_step(sched)
