"""EAGLE-3 drafting: the head loads from the published tensor names (d2t / t2d, with or without its own embedding)
and refuses bad checkpoints by name; its proposals are an independent fp32 torch forward of the EAGLE-3 head over
the target's hidden states (so the head is really computed); the output with it is plain decoding's, bit for bit,
for a random head and for a head built to agree with its target (acceptance real, rows accepting different
lengths in one step), greedy and seeded."""

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import TINY_VOCAB, save_tiny_llama

from lockstep import LLM, SamplingParams
from lockstep.models.eagle3 import default_aux_layers, load_eagle3, read_eagle3_config
from lockstep.models.loader import load_model, read_config

BLOCK = 4
H, HEADS, KV_HEADS, HEAD_DIM, INTER = 64, 4, 2, 16, 80
AUX = [0, 1, 3]  # of a 4-layer target: the embedding's stream, two middle ones
DRAFT_VOCAB = 64
PROMPTS = [[5, 17, 42, 8, 63], [12, 40, 40, 3, 3, 3, 19], [70, 3], [8, 30, 52, 61, 7, 19, 33, 2, 91, 44, 2, 85, 13]]


def eagle3_config(**overrides) -> dict:
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": H,
        "intermediate_size": INTER,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-6,
        "vocab_size": TINY_VOCAB,
        "draft_vocab_size": DRAFT_VOCAB,
        "max_position_embeddings": 256,
        "rope_theta": 10000.0,
        "torch_dtype": "float32",
        "eagle_aux_hidden_state_layer_ids": AUX,
    } | overrides


def random_head(seed: int, vocab: int = DRAFT_VOCAB, embed: bool = False) -> dict[str, torch.Tensor]:
    """Random EAGLE-3 tensors under the published names; d2t/t2d map the draft vocabulary onto ``vocab`` sorted
    target ids."""
    g = torch.Generator().manual_seed(seed)

    def mat(rows: int, cols: int, scale: float = 1.0) -> torch.Tensor:
        return scale * torch.randn(rows, cols, generator=g) / cols**0.5

    def norm() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(H, generator=g)

    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    t = {
        "fc.weight": mat(H, 3 * H),
        "midlayer.input_layernorm.weight": norm(),
        "midlayer.hidden_norm.weight": norm(),
        "midlayer.post_attention_layernorm.weight": norm(),
        "midlayer.self_attn.q_proj.weight": mat(q, 2 * H),
        "midlayer.self_attn.k_proj.weight": mat(kv, 2 * H),
        "midlayer.self_attn.v_proj.weight": mat(kv, 2 * H),
        "midlayer.self_attn.o_proj.weight": mat(H, q),
        "midlayer.mlp.gate_proj.weight": mat(INTER, H),
        "midlayer.mlp.up_proj.weight": mat(INTER, H),
        "midlayer.mlp.down_proj.weight": mat(H, INTER),
        "norm.weight": norm(),
        "lm_head.weight": mat(vocab, H, 4.0),
    }
    targets = torch.tensor(sorted(random.Random(seed).sample(range(TINY_VOCAB), vocab)))
    t["d2t"] = targets - torch.arange(vocab)
    t["t2d"] = torch.zeros(TINY_VOCAB, dtype=torch.bool)
    t["t2d"][targets] = True
    if embed:
        t["embed_tokens.weight"] = mat(TINY_VOCAB, H, 8.0)
    return t


def save_head(folder: Path, tensors: dict[str, torch.Tensor], **config) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(eagle3_config(**config)))
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "model.safetensors")
    return folder


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama of 4 layers (the head reads layers 0, 1 and 3)."""
    return save_tiny_llama(tmp_path_factory.mktemp("eagle3-target"), seed=1, num_hidden_layers=4)


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_head(tmp_path_factory.mktemp("eagle3-head"), random_head(7))


@pytest.fixture(scope="module")
def bigram(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A target whose next token depends on the current token only (every o_proj and down_proj zero: the stream is
    the token's embedding), and a head built to agree with it: fc picks that stream, the layer adds nothing
    (o_proj, down_proj zero), the final norm and LM head are the target's, so the head's argmax is the target's
    greedy token g(t) after the current one; d2t maps it one more step, to g(g(t)), the token the head must draft.
    Later drafts of a call repeat it: accepted only where the continuation sits at a fixed point of g."""
    target = save_tiny_llama(tmp_path_factory.mktemp("eagle3-bigram"), seed=4, num_hidden_layers=4)
    file = target / "model.safetensors"
    w = load_file(file)
    for name in w:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w[name] = torch.zeros_like(w[name])
    save_file(w, file)
    E, lm, final = w["model.embed_tokens.weight"], w["lm_head.weight"], w["model.norm.weight"]
    g = (_rms(E, final, 1e-6) @ lm.T).argmax(-1)  # [vocab]: the greedy token after each token
    t = random_head(5, vocab=TINY_VOCAB)
    t["fc.weight"] = torch.cat([torch.eye(H), torch.zeros(H, 2 * H)], dim=1)
    t["midlayer.self_attn.o_proj.weight"].zero_()
    t["midlayer.mlp.down_proj.weight"].zero_()
    t["norm.weight"], t["lm_head.weight"] = final.clone(), lm.clone()
    t["d2t"] = g - torch.arange(TINY_VOCAB)  # draft id v (the target's greedy token g(t)) -> target id g(v)
    del t["t2d"]  # g is not one-to-one: no mask marks exactly its image
    head = save_head(tmp_path_factory.mktemp("eagle3-bigram-head"), t, draft_vocab_size=TINY_VOCAB)
    return target, head


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _llm(target: Path, head: Path | None, k: int = 3, **kw) -> LLM:
    spec = None if head is None else {"method": "eagle3", "model": str(head), "num_speculative_tokens": k}
    return LLM(str(target), block_size=BLOCK, num_kv_blocks=256, seed=0, speculative_config=spec, **kw)


def _bits(outputs) -> list:
    return [(o.outputs[0].token_ids, [x.hex() for x in o.outputs[0].token_logprobs]) for o in outputs]


# -- loading -----------------------------------------------------------------------------------------------------


def test_loads_the_published_tensors(target_dir: Path, tmp_path: Path) -> None:
    target = load_model(target_dir)
    tensors = random_head(3)
    head = load_eagle3(save_head(tmp_path / "plain", tensors), target, target.kernels, 64)
    assert head.embed_tokens is target.language_model.embed_tokens  # no embed_tokens: the target's, shared
    assert torch.equal(head.fc.weight, tensors["fc.weight"])
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    assert torch.equal(head.self_attn.qkv_proj.weight[q : q + kv], tensors["midlayer.self_attn.k_proj.weight"])
    assert torch.equal(head.mlp.gate_up_proj.weight[INTER:], tensors["midlayer.mlp.up_proj.weight"])
    draft = torch.arange(DRAFT_VOCAB)
    mapped = head.to_target(draft)
    assert torch.equal(mapped, draft + tensors["d2t"]) and bool(tensors["t2d"][mapped].all())
    assert mapped.max() < TINY_VOCAB and len(set(mapped.tolist())) == DRAFT_VOCAB
    own = random_head(3, embed=True)
    head = load_eagle3(save_head(tmp_path / "embed", own), target, target.kernels, 64)
    assert head.embed_tokens is not target.language_model.embed_tokens
    assert torch.equal(head.embed_tokens.weight, own["embed_tokens.weight"])
    config = read_eagle3_config(tmp_path / "plain", target.config)
    assert config.aux_layers == tuple(AUX) and config.draft_vocab_size == DRAFT_VOCAB


def test_default_aux_layers_are_vllms() -> None:
    assert default_aux_layers(32) == (2, 16, 29) and default_aux_layers(36) == (2, 18, 33)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda t, c: c.update(hidden_size=32), "hidden_size 32"),
        (lambda t, c: c.update(target_hidden_size=32), "target_hidden_size 32"),
        (lambda t, c: t.pop("fc.weight"), "lacks fc.weight"),
        (lambda t, c: c.update(draft_vocab_size=48), "draft vocabulary does not match"),
        (lambda t, c: t.__setitem__("d2t", t["d2t"] + 40), "outside the target vocabulary"),
        (lambda t, c: t["t2d"].__setitem__(slice(None), True), "t2d does not mark"),
        (lambda t, c: t.__setitem__("extra.weight", torch.ones(2)), "unexpected tensor"),
        (lambda t, c: c.update(eagle_aux_hidden_state_layer_ids=[0, 1, 4]), "aux hidden-state layers"),
        (lambda t, c: c.update(architectures=["LlamaForCausalLM"]), "LlamaForCausalLMEagle3"),
    ],
)
def test_bad_checkpoints_are_value_errors(target_dir: Path, tmp_path: Path, change, match: str) -> None:
    tensors, config = random_head(3), {}
    change(tensors, config)
    folder = save_head(tmp_path / "bad", tensors, **config)
    target = load_model(target_dir)
    with pytest.raises(ValueError, match=match):
        load_eagle3(folder, target, target.kernels, 64)


def test_bad_checkpoint_fails_the_llm_with_a_value_error(target_dir: Path, tmp_path: Path) -> None:
    tensors = random_head(3)
    del tensors["fc.weight"]
    with pytest.raises(ValueError, match="lacks fc.weight"):
        _llm(target_dir, save_head(tmp_path / "nofc", tensors))


# -- the head's forward against a torch reference ---------------------------------------------------------------


def _reference_drafts(
    target_hf, w: dict[str, torch.Tensor], tokens: list[int], k: int, norm_before_residual: bool = False
) -> list[int]:
    """An fp32 torch forward of the EAGLE-3 head, written out: the target's streams entering layers AUX (hooks on
    transformers' Llama), fc, then the head over every row at once with causal attention (no cache), k times
    (``w``: the published tensor names; with ``q_norm`` / ``k_norm`` a Qwen3 layer's)."""
    streams: dict[int, torch.Tensor] = {}

    def grab(i):
        def hook(module, args, kwargs):
            streams[i] = (args[0] if args else kwargs["hidden_states"])[0]

        return hook

    hooks = [target_hf.model.layers[i].register_forward_pre_hook(grab(i), with_kwargs=True) for i in set(AUX)]
    with torch.no_grad():
        target_hf(torch.tensor([tokens[:-1]]))
    for h in hooks:
        h.remove()
    E = target_hf.model.embed_tokens.weight.detach()
    hidden = torch.cat([streams[i] for i in AUX], dim=-1) @ w["fc.weight"].T  # [n - 1, H]
    ids = list(tokens[1:])
    positions = list(range(len(tokens) - 1))
    drafts = []
    for _ in range(k):
        embeds, where = E[torch.tensor(ids)], torch.tensor(positions)
        normed, prenorm = _reference_head(w, embeds, hidden, where, norm_before_residual)
        d = int((normed[-1] @ w["lm_head.weight"].T).argmax())
        drafts.append(d + int(w["d2t"][d]))
        ids.append(drafts[-1])
        hidden = torch.cat([hidden, prenorm[-1:]])
        positions.append(positions[-1] + 1)
    return drafts


def _reference_head(w, embeds, hidden, positions, norm_before_residual=False) -> tuple[torch.Tensor, torch.Tensor]:
    eps, n = 1e-6, embeds.shape[0]
    e, h = _rms(embeds, w["midlayer.input_layernorm.weight"], eps), _rms(hidden, w["midlayer.hidden_norm.weight"], eps)
    x = torch.cat([e, h], -1)  # [n, 2H]: the token's embedding, then the hidden state
    q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(n, HEADS, HEAD_DIM)
    k = (x @ w["midlayer.self_attn.k_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM)
    v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM)
    if "midlayer.self_attn.q_norm.weight" in w:  # Qwen3: each head's q and k normed, before the rotation
        q, k = _rms(q, w["midlayer.self_attn.q_norm.weight"], eps), _rms(k, w["midlayer.self_attn.k_norm.weight"], eps)
    inv = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    angles = positions.float()[:, None] * inv[None]
    cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]

    def rotate(t):
        half = HEAD_DIM // 2
        return t * cos + torch.cat([-t[..., half:], t[..., :half]], -1) * sin

    q, k = rotate(q), rotate(k)
    k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / HEAD_DIM**0.5
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, HEADS * HEAD_DIM)
    residual = attn @ w["midlayer.self_attn.o_proj.weight"].T + (h if norm_before_residual else hidden)
    y = _rms(residual, w["midlayer.post_attention_layernorm.weight"], eps)
    gate, up = y @ w["midlayer.mlp.gate_proj.weight"].T, y @ w["midlayer.mlp.up_proj.weight"].T
    out = (torch.nn.functional.silu(gate) * up) @ w["midlayer.mlp.down_proj.weight"].T + residual
    return _rms(out, w["norm.weight"], eps), out


def _recording(llm: LLM) -> list[tuple[list[int], int, list[int]]]:
    calls = []
    propose = llm.engine.drafter.propose

    def recorded(requests):
        out = propose(requests)
        calls.extend((list(r.token_ids), r.num_tokens, p) for r, p in zip(requests, out, strict=True))
        return out

    llm.engine.drafter.propose = recorded
    return calls


def test_proposals_are_the_eagle3_forward(target_dir: Path, head_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    llm = _llm(target_dir, head_dir, k=3, enable_prefix_caching=False)
    calls = _recording(llm)
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    llm.generate(PROMPTS, params, use_tqdm=False)
    target_hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    w = load_file(head_dir / "model.safetensors")
    assert len(calls) >= 2 * len(PROMPTS)  # every request drafted in several steps, after rejections
    drafted = [p for _, _, p in calls]
    assert all(len(p) == k for p, (_, k, _) in zip(drafted, calls, strict=True))
    assert len({tuple(p) for p in drafted}) > len(drafted) // 2  # proposals vary: a stub would not
    for tokens, k, proposal in calls:
        assert proposal == _reference_drafts(target_hf, w, tokens, k), tokens


# -- output bits -------------------------------------------------------------------------------------------------

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(temperature=0.8, seed=3, top_k=40, top_p=0.95, max_tokens=24, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def qwen3_target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_models import TINY_EOS, save_char_tokenizer, save_tiny_hf

    folder = tmp_path_factory.mktemp("eagle3-qwen3")
    save_tiny_hf(folder, "qwen3", seed=2, scale=2.0, num_hidden_layers=4, bos_token_id=None, eos_token_id=TINY_EOS)
    save_char_tokenizer(folder)
    return folder


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_random_head_gives_plain_decodings_bits(request, arch: str, head_dir: Path, params: SamplingParams) -> None:
    target = request.getfixturevalue("target_dir" if arch == "llama" else "qwen3_target_dir")
    plain = _bits(_llm(target, None).generate(PROMPTS, params, use_tqdm=False))
    llm = _llm(target, head_dir, k=3)
    assert _bits(llm.generate(PROMPTS, params, use_tqdm=False)) == plain
    assert llm.engine.spec_stats.num_drafts > 0


@pytest.mark.parametrize("k", [1, 3])
def test_agreeing_head_is_accepted_and_changes_nothing(bigram: tuple[Path, Path], k: int) -> None:
    target, head = bigram
    params = [GREEDY] * 3 + [SEEDED]
    plain = _bits(_llm(target, None).generate(PROMPTS, params, use_tqdm=False))
    llm = _llm(target, head, k=k)
    assert _bits(llm.generate(PROMPTS, params, use_tqdm=False)) == plain
    stats = llm.engine.spec_stats
    # The first draft of a chunk is the target's next greedy token (the seeded row's less often); later ones
    # repeat it, as the fixture says.
    assert stats.num_drafts > 0 and stats.accepted_per_position[0] > 0.5 * stats.num_drafts, stats
    if k > 1:  # rows accept different lengths (none, one, all), in the same batch
        assert sum(1 for c in stats.chunks_by_accepted if c) >= 2, stats
    assert stats.mean_accepted_length > 1.3


def test_bigram_target_is_predictable(bigram: tuple[Path, Path]) -> None:
    """The control for the acceptance above: the bigram head's drafts are the target's own continuation."""
    target, head = bigram
    out = _llm(target, None).generate([[5, 6]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    g = load_file(head / "model.safetensors")["d2t"] + torch.arange(read_config(target).vocab_size)
    assert all(int(g[out[i]]) == out[i + 1] for i in range(len(out) - 1))  # greedy decoding follows g


def test_prefix_cache_hits_and_preemption_change_nothing(bigram: tuple[Path, Path]) -> None:
    """A prefix-cache hit leaves the head without the cached positions' features (its cache starts after them); a
    cache of 20 blocks preempts sequences mid-speculation (their head state released, rebuilt on recompute)."""
    target, head = bigram
    params = [GREEDY, SEEDED] * 2
    plain = _bits(_llm(target, None).generate(PROMPTS, params, use_tqdm=False))
    llm = _llm(target, head, k=3)
    first = _bits(llm.generate(PROMPTS, params, use_tqdm=False))
    offsets = _offsets(llm)
    again = _bits(llm.generate(PROMPTS, params, use_tqdm=False))  # the prompts' full blocks now hit the cache
    assert first == plain and again == plain
    assert max(offsets) > 0  # some head caches started after a prefix-cache hit
    small = LLM(str(target), block_size=BLOCK, num_kv_blocks=20, seed=0,
                speculative_config={"method": "eagle3", "model": str(head), "num_speculative_tokens": 3})  # fmt: skip
    preempted = []
    preempt = small.engine.scheduler._preempt
    small.engine.scheduler._preempt = lambda seq: (preempted.append(seq.arrival), preempt(seq))
    assert _bits(small.generate(PROMPTS, params, use_tqdm=False)) == plain
    assert preempted and small.engine.spec_stats.num_accepted_tokens > 0
    assert small.engine.drafter.num_free_blocks == small.engine.drafter.num_kv_blocks  # every state released


class _EveryOther:
    """The head's proposals at every other call, none at the rest (its ``observe`` still sees every step): the
    steps without drafts run ahead under async scheduling, so the next one drafts one token behind, feeding the
    head several steps' rows at once."""

    def __init__(self, inner) -> None:
        self.inner, self.calls, self.observe, self._states = inner, 0, inner.observe, inner._states

    def propose(self, requests) -> list[list[int]]:
        self.calls += 1
        return self.inner.propose(requests) if self.calls % 2 else [[] for _ in requests]

    def release(self, seq_id: int) -> None:
        self.inner.release(seq_id)


def _launches(llm: LLM) -> list[tuple[bool, bool]]:
    """``(first tokens fed on the device, has drafts)`` of every step the engine launches."""
    seen: list[tuple[bool, bool]] = []
    launch = llm.engine.runner.launch
    llm.engine.runner.launch = lambda batch, feed=None: (
        seen.append((feed is not None, batch.has_drafts)) or launch(batch, feed)
    )
    return seen


@pytest.mark.parametrize("case", ["agreeing", "every-other", "preempted"])
def test_async_scheduling_gives_plain_decodings_bits(request, bigram: tuple[Path, Path], case: str) -> None:
    """EAGLE-3 under async scheduling: the drafter observes each step as it is launched (its features enqueued on
    the device, never read back) and drafts one token behind after a step that ran ahead. Greedy and seeded rows;
    the agreeing head (rows accepting different lengths in one step), with 20 blocks too (preemption during
    speculation); the random head proposing at every other call, each proposal the head's reference forward."""
    target, head = bigram
    if case == "every-other":
        target, head = request.getfixturevalue("target_dir"), request.getfixturevalue("head_dir")
    params = [GREEDY, SEEDED] * 2
    plain = _bits(_llm(target, None).generate(PROMPTS, params, use_tqdm=False))
    blocks = 20 if case == "preempted" else 256
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    llm = LLM(str(target), block_size=BLOCK, num_kv_blocks=blocks, seed=0, speculative_config=spec,
              async_scheduling=True, enable_prefix_caching=False)  # fmt: skip
    drafter, calls = llm.engine.drafter, _recording(llm)
    if case == "every-other":
        llm.engine.drafter = _EveryOther(drafter)
    launches, offsets, preempted = _launches(llm), _offsets(llm), []
    preempt = llm.engine.scheduler._preempt
    llm.engine.scheduler._preempt = lambda seq: (preempted.append(seq.arrival), preempt(seq))
    assert _bits(llm.generate(PROMPTS, params, use_tqdm=False)) == plain
    stats = llm.engine.spec_stats
    assert (True, True) in launches  # verify chunks drafted one behind, their first token fed on the device
    # Every head cache starts at position 0 (no prefix caching): the row of the step in flight stayed pending
    # through the call that drafted one behind, so no sequence's state started over at a gap.
    assert offsets and max(offsets) == 0
    assert drafter.num_free_blocks == drafter.num_kv_blocks  # every state released
    if case == "every-other":  # steps ran ahead in the middle of decoding, not only after the prefill
        from transformers import AutoModelForCausalLM

        assert sum(fed for fed, _ in launches) >= 8 and (True, False) in launches, launches
        target_hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
        w = load_file(head / "model.safetensors")
        assert len(calls) >= 2 * len(PROMPTS) and all(len(p) == k for _, k, p in calls)
        for tokens, k, proposal in calls:  # what the head saw under async scheduling is the target's features
            assert proposal == _reference_drafts(target_hf, w, tokens, k), tokens
        return
    assert stats.num_accepted_tokens > 0 and stats.mean_accepted_length > 1.3, stats
    assert sum(1 for c in stats.chunks_by_accepted if c) >= 2, stats  # rows accept different lengths
    if case == "preempted":
        assert preempted


def _offsets(llm: LLM) -> list[int]:
    """Wrap the drafter's observe: the returned list gets each sequence state's ``offset`` after every step."""
    offsets: list[int] = []
    drafter = llm.engine.drafter
    observe = drafter.observe

    def recorded(batch, aux):
        observe(batch, aux)
        offsets.extend(s.offset for s in drafter._states.values())

    llm.engine._observe = recorded
    return offsets


def test_without_eagle3_the_target_keeps_no_aux_states(target_dir: Path, tmp_path: Path) -> None:
    plain = _llm(target_dir, None)
    plain.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    assert plain.engine.runner.aux_hidden is None and plain.engine.runner.model.language_model.aux_hidden is None
    ngram = LLM(str(target_dir), block_size=BLOCK, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert ngram.engine.runner.model.language_model.aux_layers == () and ngram.engine._observe is None


def test_generate_and_bench_take_it_on_the_command_line(
    bigram: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from lockstep.cli import main

    target, head = bigram
    spec = json.dumps({"method": "eagle3", "model": str(head), "num_speculative_tokens": 3})
    args = ["generate", "abc", "--model", str(target), "--raw", "--max-tokens", "10", "--logprobs"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main([*args, "--speculative-config", spec]) == 0
    assert capsys.readouterr().out == plain
    out = tmp_path / "bench.json"
    argv = ["bench", "throughput", "--model", str(target), "--num-prompts", "3", "--input-len", "8", "--quiet"]
    argv += ["--output-len", "12", "--num-iters-warmup", "0", "--output-json", str(out), "--device", "cpu"]
    assert main([*argv, "--speculative-config", spec]) == 0
    report = json.loads(out.read_text())
    assert report["engine"]["speculative_config"]["method"] == "eagle3"
    s = report["results"]["speculative"]
    assert s["num_accepted_tokens"] > 0 and s["mean_request_accepted_length"] > 1.0
