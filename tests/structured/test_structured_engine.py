"""Structured outputs through the engine: outputs obey their constraint, a constrained request's bits are the same
alone and among unconstrained ones (chunked, preempted, any position), its neighbours' bits do not change, and
the end of a grammar, EOS, ignore_eos, min_tokens and n > 1 behave."""

import json
import random
import re
import struct
from pathlib import Path

import pytest
from tiny_models import TINY_EOS, TINY_VOCAB

from lockstep import LLM, SamplingParams, StructuredOutputsParams
from lockstep.structured.grammar import GrammarError

BLOCK = 4
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "ok": {"type": "boolean"},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "ok", "role"],
    "additionalProperties": False,
}
CONSTRAINTS = {
    "json": StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
    "regex": StructuredOutputsParams(regex=r"[a-f]{2,5}-[0-9]{3}"),
    "choice": StructuredOutputsParams(choice=["north", "south", "east", "west"]),
    "grammar": StructuredOutputsParams(grammar='start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,2}/'),
}
TARGET_PROMPTS = ["name: ", "Q", "where to?", "sum"]
TARGET_PARAMS = [
    SamplingParams(temperature=0, max_tokens=60, logprobs=2, structured_outputs=CONSTRAINTS["json"]),
    SamplingParams(temperature=0.9, seed=7, max_tokens=30, logprobs=2, structured_outputs=CONSTRAINTS["regex"]),
    SamplingParams(temperature=1.0, seed=11, max_tokens=30, structured_outputs=CONSTRAINTS["choice"]),
    SamplingParams(temperature=0.8, seed=3, top_k=20, max_tokens=40, structured_outputs=CONSTRAINTS["grammar"]),
]


def check(kind: str, text: str) -> None:
    """The output obeys its constraint."""
    if kind == "json":
        obj = json.loads(text)
        assert set(obj) == {"name", "age", "ok", "role"}
        assert isinstance(obj["name"], str) and len(obj["name"]) <= 6
        assert isinstance(obj["age"], int) and 0 <= obj["age"] <= 150 and isinstance(obj["ok"], bool)
        assert obj["role"] in ("admin", "user", "guest")
    elif kind == "regex":
        assert re.fullmatch(r"[a-f]{2,5}-[0-9]{3}", text), text
    elif kind == "choice":
        assert text in ("north", "south", "east", "west"), text
    else:
        assert re.fullmatch(r"\((\d{1,2})(\+\d{1,2})*\)", text), text


def bits(out) -> tuple:
    as_bits = lambda xs: tuple(struct.pack("<d", x) for x in xs)
    tops = tuple(tuple((t, struct.pack("<d", v.logprob)) for t, v in d.items()) for d in out.logprobs or ())
    return tuple(out.token_ids), as_bits(out.token_logprobs), tops, out.finish_reason, out.text


def make_llm(folder: Path, **kwargs) -> LLM:
    kwargs.setdefault("block_size", BLOCK)
    kwargs.setdefault("num_kv_blocks", 512)
    return LLM(str(folder), seed=0, **kwargs)


def others(rng: random.Random, n: int) -> tuple[list, list[SamplingParams]]:
    prompts, params = [], []
    for _ in range(n):
        prompts.append([rng.randrange(TINY_VOCAB - 2) for _ in range(rng.randrange(1, 30))])
        params.append(
            SamplingParams(
                temperature=rng.choice([0, 0.7]), seed=rng.randrange(1000), max_tokens=rng.randrange(1, 30), logprobs=1
            )
        )
    return prompts, params


def run_mixed(llm: LLM, num_others: int, seed: int) -> tuple[list, list]:
    """The targets among ``num_others`` unconstrained requests at random positions: (targets', others' outputs)."""
    rng = random.Random(seed)
    prompts, params = others(rng, num_others)
    slots = sorted(rng.sample(range(num_others + len(TARGET_PROMPTS)), len(TARGET_PROMPTS)))
    for slot, prompt, p in zip(slots, TARGET_PROMPTS, TARGET_PARAMS, strict=True):
        prompts.insert(slot, prompt)
        params.insert(slot, p)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [outs[s] for s in slots], [o for i, o in enumerate(outs) if i not in slots]


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> list[tuple]:
    refs = []
    for kind, prompt, p in zip(CONSTRAINTS, TARGET_PROMPTS, TARGET_PARAMS, strict=True):
        [out] = make_llm(tiny_model_dir).generate([prompt], p, use_tqdm=False)
        assert out.finish_reason == "stop" and out.token_ids[-1] == TINY_EOS, (kind, out.text)
        check(kind, out.text)
        refs.append(bits(out))
    return refs


MATRIX = {
    "batch_of_10": ({}, 6, 0),
    "batch_of_40": ({}, 36, 1),
    "chunked_16": ({"max_num_batched_tokens": 16, "max_num_seqs": 16}, 10, 2),
    "max_num_seqs_2": ({"max_num_seqs": 2}, 5, 3),
}


@pytest.mark.parametrize("case", list(MATRIX))
def test_constrained_bits_alone_and_batched(tiny_model_dir: Path, reference: list[tuple], case: str) -> None:
    kwargs, num_others, seed = MATRIX[case]
    targets, _ = run_mixed(make_llm(tiny_model_dir, **kwargs), num_others, seed)
    assert [bits(o) for o in targets] == reference


def test_unconstrained_neighbours_are_unaffected(tiny_model_dir: Path) -> None:
    # The same unconstrained requests with and without constrained ones among them: the same bits.
    rng = random.Random(4)
    prompts, params = others(rng, 12)
    alone = make_llm(tiny_model_dir).generate(prompts, params, use_tqdm=False)
    _, mixed = run_mixed(make_llm(tiny_model_dir), 12, 4)
    assert [bits(o) for o in mixed] == [bits(o) for o in alone]


def test_constrained_bits_after_preemption(tiny_model_dir: Path, reference: list[tuple]) -> None:
    llm = make_llm(tiny_model_dir, num_kv_blocks=20, max_num_batched_tokens=64, max_num_seqs=64)
    preempted = []
    schedule = llm.engine.scheduler.schedule

    def spy():
        batch = schedule()
        preempted.extend(s for s in batch.preempted if s.grammar is not None and s.num_output_tokens)
        return batch

    llm.engine.scheduler.schedule = spy
    targets, _ = run_mixed(llm, 10, 5)
    assert preempted, "no constrained request was preempted mid-output"
    assert [bits(o) for o in targets] == reference


def test_negative_control_the_mask_changes_the_output(tiny_model_dir: Path, reference: list[tuple]) -> None:
    # The same requests without their constraint give other tokens: the comparisons above see the mask.
    llm = make_llm(tiny_model_dir)
    for prompt, p, ref in zip(TARGET_PROMPTS, TARGET_PARAMS, reference, strict=True):
        [free] = llm.generate([prompt], SamplingParams(**{**vars(p), "structured_outputs": None}), use_tqdm=False)
        assert tuple(free.token_ids) != ref[0]


def test_logprobs_stay_those_of_the_raw_distribution(tiny_model_dir: Path) -> None:
    # A constrained token's logprob is the model's, as a prefill of the same tokens reports it (bit for bit).
    llm = make_llm(tiny_model_dir)
    [out] = llm.generate([TARGET_PROMPTS[0]], TARGET_PARAMS[0], use_tqdm=False)
    prompt = llm.tokenizer.encode(TARGET_PROMPTS[0])
    p = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    [replay] = llm.generate([prompt + out.token_ids[:-1]], p, use_tqdm=False)
    replayed = [d[t].logprob for d, t in zip(replay.prompt_logprobs[len(prompt) :], out.token_ids[:-1], strict=True)]
    assert replayed == out.token_logprobs[:-1]


def test_n_choices_each_follow_the_grammar(tiny_model_dir: Path) -> None:
    llm = make_llm(tiny_model_dir)
    p = SamplingParams(temperature=1.0, seed=5, n=4, max_tokens=60, structured_outputs=CONSTRAINTS["json"])
    [out] = llm.generate(["x"], p, use_tqdm=False)
    for choice in out.outputs:
        check("json", choice.text)
    assert len({c.text for c in out.outputs}) > 1
    # Choice i alone with n=1 and its own seed: the same bits (the grammar state is per choice).
    [alone] = llm.generate(["x"], p.for_choice(2), use_tqdm=False)
    assert bits(alone.outputs[0]) == bits(out.outputs[2])


def test_end_of_grammar_with_ignore_eos_and_min_tokens(tiny_model_dir: Path) -> None:
    llm = make_llm(tiny_model_dir)
    choice = CONSTRAINTS["choice"]
    greedy = SamplingParams(temperature=0, max_tokens=20, structured_outputs=choice)
    [plain] = llm.generate(["go"], greedy, use_tqdm=False)
    assert plain.token_ids[-1] == TINY_EOS and plain.text in choice.choice
    # EOS may not end these requests: the grammar's end does, with the same text and no EOS.
    for extra in ({"ignore_eos": True}, {"min_tokens": 15}):
        p = SamplingParams(temperature=0, max_tokens=20, structured_outputs=choice, **extra)
        [out] = llm.generate(["go"], p, use_tqdm=False)
        assert (out.text, out.finish_reason) == (plain.text, "stop")
        assert out.token_ids == plain.token_ids[:-1]
    # max_tokens cuts a constrained output like any other.
    [cut] = llm.generate(["go"], SamplingParams(temperature=0, max_tokens=2, structured_outputs=choice), use_tqdm=False)
    assert cut.finish_reason == "length" and plain.text.startswith(cut.text) and len(cut.token_ids) == 2


def test_bad_grammar_raises_and_the_engine_keeps_working(tiny_model_dir: Path) -> None:
    llm = make_llm(tiny_model_dir)
    ok = SamplingParams(temperature=0, max_tokens=30, structured_outputs=CONSTRAINTS["regex"])
    [before] = llm.generate(["a"], ok, use_tqdm=False)
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object", "properties": 3}))
    with pytest.raises(GrammarError, match=r"request '\d+': invalid json"):
        llm.generate(["a", "b"], [ok, bad], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    # A constraint the tokenizer cannot write (a newline: this one writes it as <unk>, which llguidance takes at
    # its word and allows) from its start is refused when it is added (its first step is checked then); one that
    # reaches the newline later fails its request alone, saying why.
    forced = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a\nb"), temperature=0)
    with pytest.raises(GrammarError, match=r"request '\d+': invalid regex .* fails at its first step"):
        llm.generate(["a"], forced, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    unwritable = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[ab]\nb"), temperature=0)
    outs = llm.generate(["a", "a"], [unwritable, ok], use_tqdm=False)
    assert outs[0].finish_reason == "abort" and "grammar rejects the output" in outs[0].outputs[0].error
    assert bits(outs[1]) == bits(before)
    [after] = llm.generate(["a"], ok, use_tqdm=False)
    assert bits(after) == bits(before)


def test_chat_passes_tools_and_template_variables(tiny_model_dir: Path) -> None:
    # vLLM's LLM.chat(..., tools=...): the tools and chat_template_kwargs reach the template.
    template = "{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}{{ greeting }}{{ messages[0].content }}:"
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    llm = make_llm(tiny_model_dir)
    p = SamplingParams(temperature=0, max_tokens=2, structured_outputs=CONSTRAINTS["choice"])
    [out] = llm.chat(
        [{"role": "user", "content": "hi"}], p, chat_template=template, tools=[tool],
        chat_template_kwargs={"greeting": "hello "}, use_tqdm=False,
    )  # fmt: skip
    assert out.prompt == "[get_weather]hello hi:"


def test_reasoning_end_leaves_the_reasoning_free_and_batching_changes_nothing(tiny_model_dir: Path) -> None:
    # The marker is taken from the free output itself, so it certainly comes: up to it the constrained request
    # samples exactly what the free one does (the mask allows every token), after it the regex holds.
    llm = make_llm(tiny_model_dir)
    free_params = SamplingParams(temperature=1.0, seed=21, max_tokens=40, logprobs=1)
    [free] = llm.generate(["think"], free_params, use_tqdm=False)
    marker = free.text[4:6]
    cut = free.text.find(marker) + len(marker)
    constraint = StructuredOutputsParams(regex=r"[a-f]{2,5}-[0-9]{3}", reasoning_end=marker)
    p = SamplingParams(temperature=1.0, seed=21, max_tokens=40, logprobs=1, structured_outputs=constraint)
    [out] = llm.generate(["think"], p, use_tqdm=False)
    assert out.token_ids[:cut] == free.token_ids[:cut] and out.text[:cut] == free.text[:cut]
    assert re.fullmatch(r"[a-f]{2,5}-[0-9]{3}", out.text[cut:]) and out.finish_reason == "stop", out.text
    # Alone or among unconstrained requests, chunked, two at a time: the same bits.
    for kwargs, seed in (({}, 6), ({"max_num_batched_tokens": 16, "max_num_seqs": 2}, 7)):
        rng = random.Random(seed)
        prompts, params = others(rng, 7)
        prompts.insert(3, "think")
        params.insert(3, p)
        mixed = make_llm(tiny_model_dir, **kwargs).generate(prompts, params, use_tqdm=False)
        assert bits(mixed[3]) == bits(out)
