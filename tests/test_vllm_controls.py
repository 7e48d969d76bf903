"""vLLM's output controls in SamplingParams, end to end on the tiny model: min_tokens, stop strings kept or not,
special tokens in the text, prompt truncation, allowed_token_ids and bad_words; and a bad value named with its
field."""

import time
from pathlib import Path

import pytest
from tiny_models import TINY_CHARS, TINY_EOS, TINY_VOCAB

from lockstep.layers.token_bans import bad_words_token_ids
from lockstep.llm import LLM
from lockstep.sampling_params import SamplingParams

UNK = TINY_VOCAB - 2  # the char tokenizer's other special token


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return LLM(str(tiny_model_dir), block_size=4, num_kv_blocks=512, seed=0, max_logprobs=-1)


def one(llm: LLM, prompt, **kwargs):
    [out] = llm.generate(prompt, SamplingParams(**kwargs), use_tqdm=False)
    return out


def test_min_tokens_holds_back_eos_and_stop_token_ids(llm: LLM) -> None:
    # EOS pushed to the top: without min_tokens it is the first token; with min_tokens=5 it comes sixth.
    assert one(llm, "hello", temperature=0, logit_bias={TINY_EOS: 100}).token_ids == [TINY_EOS]
    out = one(llm, "hello", temperature=0, logit_bias={TINY_EOS: 100}, min_tokens=5)
    assert out.finish_reason == "stop" and out.token_ids[5:] == [TINY_EOS] and TINY_EOS not in out.token_ids[:5]
    # Logprobs stay those of the raw distribution: EOS's own, at the step that chose it, is the same either way.
    alone = one(llm, [out.prompt_token_ids + out.token_ids[:5]], temperature=0, logit_bias={TINY_EOS: 100})
    assert alone.token_ids == [TINY_EOS] and alone.token_logprobs == out.token_logprobs[5:]
    t = 40  # a stop token id is held back the same way
    out = one(llm, "hello", temperature=0, logit_bias={t: 100}, stop_token_ids=[t], min_tokens=3, ignore_eos=True)
    assert out.token_ids[3:] == [t] and t not in out.token_ids[:3]
    # With ignore_eos, EOS is an ordinary token (as in vLLM): not held back.
    out = one(llm, "hello", temperature=0, logit_bias={TINY_EOS: 100}, min_tokens=3, max_tokens=4, ignore_eos=True)
    assert out.token_ids == [TINY_EOS] * 4
    # A sampled request too: the same seed, the noise unchanged, only the banned ids out of reach.
    kw = dict(temperature=1.0, seed=7, logit_bias={TINY_EOS: 4.0}, max_tokens=30)
    free, held = one(llm, "hello", **kw), one(llm, "hello", **kw, min_tokens=20)
    assert TINY_EOS in free.token_ids[:20] and TINY_EOS not in held.token_ids[:20]


def test_stop_strings_with_min_tokens_and_include_stop_str_in_output(llm: LLM) -> None:
    greedy = dict(temperature=0, max_tokens=24, ignore_eos=True)
    free = one(llm, "abc", **greedy)
    s = free.text[:2]  # the char tokenizer: one character per token
    assert one(llm, "abc", **greedy, stop=[s]).text == ""
    # The first two tokens' text cannot hold a stop with min_tokens=2; the next occurrence (if any) ends it.
    held = one(llm, "abc", **greedy, stop=[s], min_tokens=2)
    later = free.text.find(s, 1)
    assert held.text == (free.text if later < 0 else free.text[:later])
    # A stop string that ends after the min_tokens text counts, even if it began inside it.
    straddle = one(llm, "abc", **greedy, stop=[s], min_tokens=1)
    assert straddle.text == "" and straddle.token_ids == free.token_ids[:2] and straddle.finish_reason == "stop"
    stop = free.text[5:7]
    kept = one(llm, "abc", **greedy, stop=[stop], include_stop_str_in_output=True)
    cut = free.text.find(stop)
    assert kept.text == free.text[: cut + 2] and one(llm, "abc", **greedy, stop=[stop]).text == free.text[:cut]


def test_special_tokens_in_the_text(llm: LLM) -> None:
    # Sampled with both special tokens made likely: a mix of special and ordinary tokens.
    kw = dict(temperature=1.0, seed=3, logit_bias={TINY_EOS: 2.0, UNK: 2.0}, max_tokens=16, ignore_eos=True)
    out = one(llm, "hello", **kw)
    special = {TINY_EOS: "</s>", UNK: "<unk>"}
    assert set(out.token_ids) & set(special) and set(out.token_ids) - set(special)
    assert out.text == "".join(TINY_CHARS[t] for t in out.token_ids if t not in special)
    raw = one(llm, "hello", **kw, skip_special_tokens=False, spaces_between_special_tokens=False)
    assert raw.token_ids == out.token_ids
    assert raw.text == "".join(special.get(t) or TINY_CHARS[t] for t in out.token_ids)
    # Spaces around each special token: the ordinary runs between them stay as they are.
    pieces, run = [], ""
    for t in out.token_ids:
        if t in special:
            pieces += [run, special[t]] if run else [special[t]]
            run = ""
        else:
            run += TINY_CHARS[t]
    pieces += [run] if run else []
    spaced = one(llm, "hello", **kw, skip_special_tokens=False)
    assert spaced.text == " ".join(pieces) != raw.text
    # The same text when stop strings make the engine detokenize step by step (a stop string that never occurs).
    assert one(llm, "hello", **kw, skip_special_tokens=False, stop=["~~~~"]).text == spaced.text


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm: LLM) -> None:
    greedy = dict(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = list(range(3, 23))
    cut = one(llm, [prompt], **greedy, truncate_prompt_tokens=5)
    assert cut.prompt_token_ids == prompt[-5:]
    assert cut.token_ids == one(llm, [prompt[-5:]], **greedy).token_ids
    assert one(llm, [prompt], **greedy, truncate_prompt_tokens=50).prompt_token_ids == prompt
    # -1: as many as leave room to generate (max_model_len - 1); the prompt alone would not fit.
    long = [5] * 300
    with pytest.raises(ValueError, match="300 tokens"):
        one(llm, [long], **greedy)
    assert len(one(llm, [long], **greedy, truncate_prompt_tokens=-1).prompt_token_ids) == 255


def ids_of(text: str) -> list[int]:
    return [TINY_CHARS.index(c) for c in text]


def test_allowed_token_ids_choose_from_those_alone_with_raw_logprobs(llm: LLM) -> None:
    greedy = dict(temperature=0, max_tokens=6, ignore_eos=True)
    free = one(llm, "hello", **greedy, logprobs=-1)  # vLLM's -1: every token ranked, the raw distribution
    assert all(len(step) == TINY_VOCAB for step in free.logprobs)
    allowed = ids_of("xyz")
    assert not set(free.token_ids) <= set(allowed)  # the harness: unconstrained, it leaves the set
    out = one(llm, "hello", **greedy, allowed_token_ids=allowed)
    assert set(out.token_ids) <= set(allowed)
    # The best of the three, by the raw logits, at step 0; its logprob is the raw distribution's, bit for bit.
    first = max(allowed, key=lambda t: (free.logprobs[0][t].logprob, -t))
    assert out.token_ids[0] == first and out.token_logprobs[0] == free.logprobs[0][first].logprob
    # Sampled rows obey it too.
    sampled = one(llm, "hello", temperature=1.0, seed=3, max_tokens=12, ignore_eos=True, allowed_token_ids=allowed)
    assert set(sampled.token_ids) <= set(allowed) and len(set(sampled.token_ids)) > 1
    with pytest.raises(ValueError, match="allowed_token_ids holds token id 500"):
        one(llm, "hello", allowed_token_ids=[3, 500])


def test_bad_words_ban_the_last_token_after_the_rest(llm: LLM) -> None:
    greedy = dict(temperature=0, max_tokens=8, ignore_eos=True)
    base = one(llm, "hello", **greedy)
    text = base.text
    assert len(text) == 8 and text[0] != text[1]
    # A one-token word is banned at every step.
    out = one(llm, "hello", **greedy, bad_words=[text[0]])
    assert out.token_ids[0] != base.token_ids[0] and text[0] not in out.text
    # A two-token word: its first token may come, but not followed by its second.
    out = one(llm, "hello", **greedy, bad_words=[text[:2]])
    assert out.token_ids[0] == base.token_ids[0] and out.token_ids[1] != base.token_ids[1]
    assert text[:2] not in out.text
    # Only output tokens count: a word begun by the prompt's last token does not ban the first output token.
    assert one(llm, "hello", **greedy, bad_words=["o" + text[0]]).token_ids[0] == base.token_ids[0]
    # Leading whitespace is stripped (vLLM's rule); with one token per character " ab" is longer than "ab", so no
    # space-prefixed form is added (lockstep.layers.token_bans: the same length is required).
    assert bad_words_token_ids(["  " + text[:2], "q"], llm.get_tokenizer()) == [ids_of(text[:2]), ids_of("q")]
    with pytest.raises(ValueError, match="at least one token"):
        one(llm, "hello", bad_words=["   "])


def test_bad_words_take_the_leading_space_form_as_vllm_does(embedded_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(embedded_model_dir)
    plain, spaced = tok.encode("Paris", add_special_tokens=False), tok.encode(" Paris", add_special_tokens=False)
    assert len(plain) == len(spaced) and plain[0] != spaced[0]  # byte-level BPE: another token mid-text
    assert bad_words_token_ids(["Paris", " Paris"], tok) == [plain, spaced, plain, spaced]
    # A space form of another length is left out (vLLM's rule), the plain form kept: digits are one token each,
    # and " 123" is a space token before them.
    assert tok.encode(" 123", add_special_tokens=False)[1:] == tok.encode("123", add_special_tokens=False)
    assert bad_words_token_ids(["123"], tok) == [tok.encode("123", add_special_tokens=False)]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 17}, "min_tokens"),  # more than max_tokens (16)
        ({"min_tokens": 1.0}, "min_tokens"),
        ({"prompt_logprobs": -2}, "prompt_logprobs"),
        ({"logprobs": -2}, "logprobs"),
        ({"prompt_logprobs": True}, "prompt_logprobs"),
        ({"skip_special_tokens": 0}, "skip_special_tokens"),
        ({"spaces_between_special_tokens": "yes"}, "spaces_between_special_tokens"),
        ({"include_stop_str_in_output": None}, "include_stop_str_in_output"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": 2.5}, "truncate_prompt_tokens"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [1, -2]}, "allowed_token_ids"),
        ({"bad_words": "word"}, "bad_words"),
        ({"bad_words": ["a", 3]}, "bad_words"),
    ],
)
def test_invalid_values_name_field_and_value(kwargs, field) -> None:
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert str(err.value).startswith(field) and repr(next(iter(kwargs.values()))) in str(err.value)


def test_max_logprobs_caps_what_a_request_may_ask_for(tiny_model_dir: Path) -> None:
    default = LLM(str(tiny_model_dir), block_size=4, num_kv_blocks=64)  # vLLM's default cap: 20
    assert len(one(default, "hi", max_tokens=1, logprobs=20).logprobs[0]) in (20, 21)
    for kwargs, name in (({"logprobs": 21}, "logprobs"), ({"logprobs": -1}, "logprobs"),
                         ({"prompt_logprobs": -1}, "prompt_logprobs")):  # fmt: skip
        with pytest.raises(ValueError, match=f"requested {name} of {kwargs[name] if kwargs[name] > 0 else TINY_VOCAB}"):
            one(default, "hi", max_tokens=1, **kwargs)
    with pytest.raises(ValueError, match="max_logprobs"):
        LLM(str(tiny_model_dir), max_logprobs=-2)


def test_request_metrics_and_cached_tokens(llm: LLM) -> None:
    prompt = "a prompt of seven full blocks"  # 29 tokens: 7 full blocks of 4
    first = one(llm, prompt, max_tokens=3, temperature=0, ignore_eos=True)
    again = one(llm, prompt, max_tokens=3, temperature=0, ignore_eos=True)
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 28  # vLLM's field: prefix-cache hits
    assert again.token_ids == first.token_ids
    m = again.metrics
    assert m.num_generation_tokens == 3 and not m.is_corrupted
    assert 0 < m.queued_ts <= m.scheduled_ts <= m.first_token_ts <= m.last_token_ts
    assert m.first_token_latency == m.first_token_ts - m.queued_ts and abs(m.arrival_time - time.time()) < 600


def test_chat_modes_and_a_default_template(llm: LLM, tiny_model_dir: Path, tmp_path: Path) -> None:
    convo = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The ans"}]
    greedy = SamplingParams(temperature=0, max_tokens=2)
    [out] = llm.chat(convo, greedy, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)
    continued = llm.get_tokenizer().encode("user: hi\nassistant: The ans", add_special_tokens=False)
    assert out.prompt_token_ids == continued  # the final message continued, the template's closing newline cut
    with pytest.raises(ValueError, match="both"):
        llm.chat(convo, greedy, continue_final_message=True)
    # vLLM's LLM(chat_template=...): a template, or a file holding one, for calls that name none.
    (tmp_path / "t.jinja").write_text("{{ messages[0]['content'] }}!")
    for template in ("{{ messages[0]['content'] }}!", str(tmp_path / "t.jinja")):
        custom = LLM(str(tiny_model_dir), block_size=4, num_kv_blocks=64, chat_template=template)
        [out] = custom.chat(convo, greedy, use_tqdm=False)
        assert custom.get_tokenizer().decode(out.prompt_token_ids) == "hi!"
