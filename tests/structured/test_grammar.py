"""The grammar layer on its own: constraints to masks, state fed by tokens, errors, the cache."""

import re
from pathlib import Path

import pytest
import torch
from tiny_models import TINY_EOS, TINY_VOCAB, save_char_tokenizer

from lockstep.structured import StructuredOutputsParams as S
from lockstep.structured.cache import GrammarCache
from lockstep.structured.grammar import (
    GrammarCompiler,
    GrammarError,
    _closed_objects,
    ascii_classes,
    token_masks,
    unpack_bitmask,
)
from lockstep.structured.limits import MAX_SCHEMA_DEPTH, GrammarLimits, charge, depth


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("char-tok")
    save_char_tokenizer(folder)
    return AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def compiler(tok) -> GrammarCompiler:
    return GrammarCompiler(tok, TINY_VOCAB, [TINY_EOS])


def ids(tok, text: str) -> list[int]:
    return [tok.convert_tokens_to_ids(c) for c in text]


def allowed_text(tok, state, output: list[int], allow_eos: bool = True) -> set[str]:
    mask = token_masks([(state, output, allow_eos)], TINY_VOCAB, "cpu")[0]
    return {"EOS" if t == TINY_EOS else tok.convert_ids_to_tokens(t) for t in mask.nonzero().flatten().tolist()}


def test_params_take_exactly_one_constraint() -> None:
    with pytest.raises(ValueError, match="exactly one .* got none"):
        S()
    with pytest.raises(ValueError, match="exactly one .* got regex, choice"):
        S(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="not valid JSON text"):
        S(json="{nope")
    with pytest.raises(ValueError, match="non-empty list"):
        S(choice=[])
    with pytest.raises(ValueError, match="every choice"):
        S(choice=["a", ""])
    with pytest.raises(ValueError, match="exactly one"):
        S(json_object=False)
    assert S(json='{"type": "object"}').json == {"type": "object"}
    assert S(json={"b": 1, "a": 2}).key == S(json={"a": 2, "b": 1}).key
    assert S(json={"a": 1}).key != S(json={"a": 1}, disable_any_whitespace=True).key
    assert S(choice=["x"]).kind == "choice" and S(json_object=True).kind == "json_object"


def test_regex_mask_follows_the_tokens(tok, compiler: GrammarCompiler) -> None:
    state = compiler.start(S(regex=r"[0-9]{2}(px|em)"))
    assert allowed_text(tok, state, []) == set("0123456789")
    assert allowed_text(tok, state, ids(tok, "4")) == set("0123456789")
    assert allowed_text(tok, state, ids(tok, "42")) == {"p", "e"}
    assert not state.finished
    assert allowed_text(tok, state, ids(tok, "42p")) == {"x"}
    assert allowed_text(tok, state, ids(tok, "42px")) == {"EOS"}
    assert state.finished
    # Without EOS (ignore_eos), a finished grammar allows nothing: the engine ends such a request itself.
    assert allowed_text(tok, state, ids(tok, "42px"), allow_eos=False) == set()


def test_state_is_a_function_of_the_tokens(tok, compiler: GrammarCompiler) -> None:
    # Tokens that go back (any rewind) replay from the start: the same tokens give the same mask.
    state = compiler.start(S(choice=["red", "rose", "blue"]))
    assert allowed_text(tok, state, ids(tok, "r")) == {"e", "o"}
    assert allowed_text(tok, state, ids(tok, "re")) == {"d"}
    assert allowed_text(tok, state, ids(tok, "b")) == {"l"}
    assert allowed_text(tok, state, []) == {"r", "b"}
    fresh = compiler.start(S(choice=["red", "rose", "blue"]))
    assert allowed_text(tok, fresh, ids(tok, "ro")) == allowed_text(tok, state, ids(tok, "ro")) == {"s"}


def test_reasoning_end_frees_the_output_until_the_marker(tok, compiler: GrammarCompiler) -> None:
    # "</think>" is 8 tokens here (one a character): the grammar starts after the first whole occurrence.
    everything = allowed_text(tok, compiler.start(S(regex=".*")), [])  # printable characters and EOS
    state = compiler.start(S(regex="[0-9]+", reasoning_end="</think>"))
    assert compiler.marker("</think>") == tuple(ids(tok, "</think>"))
    for prefix in ("", "so, x < y", "hmm </think", "a </thin> b </think"):
        assert allowed_text(tok, state, ids(tok, prefix)) >= everything
        assert "EOS" not in allowed_text(tok, state, ids(tok, prefix), allow_eos=False)
        assert not state.finished
    reasoned = ids(tok, "a </thin> b </think>")
    assert allowed_text(tok, state, reasoned) == set("0123456789")
    assert allowed_text(tok, state, reasoned + ids(tok, "42")) == set("0123456789") | {"EOS"}
    # A second marker is output like any other text: the grammar has started.
    with pytest.raises(GrammarError):
        state.advance(reasoned + ids(tok, "4</think>"))
    # The same tokens give the same mask, whatever came before (a fresh state, tokens going back).
    fresh = compiler.start(S(regex="[0-9]+", reasoning_end="</think>"))
    assert allowed_text(tok, fresh, reasoned + ids(tok, "7")) == allowed_text(tok, state, reasoned + ids(tok, "7"))
    assert allowed_text(tok, state, ids(tok, "back </thi")) >= everything
    assert allowed_text(tok, state, reasoned) == set("0123456789")
    # Negative control: without the marker the grammar applies from the first token.
    assert allowed_text(tok, compiler.start(S(regex="[0-9]+")), ids(tok, "")) == set("0123456789")
    with pytest.raises(ValueError, match="reasoning_end"):
        S(regex="a", reasoning_end="")


def test_json_schema_mask(tok, compiler: GrammarCompiler) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    compact = compiler.start(S(json=schema, disable_any_whitespace=True))
    assert allowed_text(tok, compact, []) == {"{"}
    assert allowed_text(tok, compact, ids(tok, '{"a":1')) == set("0123456789") | {",", "}"}
    loose = compiler.start(S(json=schema))
    assert allowed_text(tok, loose, ids(tok, "{")) == {" ", '"'}  # vLLM's default: any whitespace (" " here)
    closed = compiler.start(S(json=schema, disable_additional_properties=True))
    assert "," not in allowed_text(tok, closed, ids(tok, '{"a":1'))
    with pytest.raises(GrammarError, match="rejects the output"):
        compact.advance(ids(tok, '{"a":1x'))
    # Other tokens of the same length are not an extension: the state replays them.
    with pytest.raises(GrammarError, match="rejects the output"):
        compact.advance(ids(tok, '{"a":x'))
    assert allowed_text(tok, compact, ids(tok, '{"a":')) == set("-0123456789")


def test_closed_objects_marks_every_object_schema() -> None:
    schema = {"type": "object", "properties": {"x": {"type": "object", "properties": {}}, "y": {"type": "integer"}}}
    closed = _closed_objects(schema)
    assert closed["additionalProperties"] is False and closed["properties"]["x"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]["y"]
    assert _closed_objects({"type": "object", "additionalProperties": True})["additionalProperties"] is True


def test_grammars_lark_and_gbnf(tok, compiler: GrammarCompiler) -> None:
    lark = compiler.start(S(grammar='start: "go " DIR\nDIR: "north" | "south"'))
    assert allowed_text(tok, lark, ids(tok, "go ")) == {"n", "s"}
    gbnf = compiler.start(S(grammar='root ::= "x" [0-9]+'))
    assert allowed_text(tok, gbnf, ids(tok, "x1")) == set("0123456789") | {"EOS"}


@pytest.mark.parametrize(
    "params, pattern",
    [
        (S(regex="[0-9"), "invalid regex.*unclosed character class"),
        (S(json={"type": "frob"}), "invalid json.*frob"),
        (S(json={"$ref": "#/definitions/missing"}), "invalid json"),
        (S(grammar="start: undefined_rule"), "invalid grammar.*undefined_rule"),
        (S(grammar="root ::= ("), "invalid grammar"),
    ],
)
def test_bad_constraints_raise_grammar_error(compiler: GrammarCompiler, params: S, pattern: str) -> None:
    with pytest.raises(GrammarError, match=re.compile(pattern, re.S)):
        compiler.compile(params)


def test_cache_is_keyed_by_the_constraint(compiler: GrammarCompiler) -> None:
    a = compiler.compile(S(json={"type": "object", "properties": {"k": {"type": "string"}}}))
    b = compiler.compile(S(json='{"properties": {"k": {"type": "string"}}, "type": "object"}'))
    assert a is b


def test_cache_is_bounded_by_bytes_least_recently_used_out() -> None:
    cache = GrammarCache(100)
    for key, charge_ in (("a", 40), ("b", 40), ("c", 10)):
        cache.put(key, key.upper(), charge_)
    assert cache.get("a") == "A" and cache.bytes == 90  # a is now the most recently used
    cache.put("d", "D", 30)  # 120 > 100: b, the least recently used, goes
    assert "b" not in cache and [k for k in "acd" if k in cache] == ["a", "c", "d"] and cache.bytes == 80
    cache.put("a", "A2", 20)  # replaced, not counted twice
    assert cache.get("a") == "A2" and cache.bytes == 60 and len(cache) == 3
    cache.put("huge", "H", 101)  # larger than the budget: not kept, nothing dropped for it
    assert "huge" not in cache and len(cache) == 3 and cache.bytes == 60


def test_compiler_cache_holds_at_most_its_bytes(tok) -> None:
    params = [S(regex=f"(x{i}|y{i}){{1,{i + 2}}}") for i in range(40)]
    budget = 10 * charge(params[0].size)
    compiler = GrammarCompiler(tok, TINY_VOCAB, [TINY_EOS], GrammarLimits(max_bytes=1000, cache_bytes=budget))
    for p in params:
        compiler.compile(p)
    assert compiler.cache_bytes == sum(charge(p.size) for p in params[-compiler.cache_entries :])
    assert compiler.cache_bytes <= budget and 8 <= compiler.cache_entries <= 10
    kept = params[-1].key in compiler._cache and params[0].key not in compiler._cache
    assert kept  # the oldest went first


def test_limits_refuse_large_deep_and_many_before_compiling(tok) -> None:
    compiler = GrammarCompiler(tok, TINY_VOCAB, [TINY_EOS], GrammarLimits(max_bytes=2000, max_choices=50))
    with pytest.raises(GrammarError, match="2000 .*--max-structured-output-bytes"):
        compiler.compile(S(json={"enum": [f"v{i}" for i in range(500)]}))
    with pytest.raises(GrammarError, match="at most 50 .*--max-structured-output-choices"):
        compiler.compile(S(choice=[f"c{i}" for i in range(51)]))
    deep = {"type": "integer"}
    for _ in range(300):  # 600 objects deep: json.dumps and a recursive walk would raise RecursionError
        deep = {"type": "object", "properties": {"a": deep}}
    assert depth(deep) == 601
    for params in (S(json=deep), S(json=deep, disable_additional_properties=True)):
        with pytest.raises(GrammarError, match=f"deeper than {MAX_SCHEMA_DEPTH}"):
            compiler.compile(params)
    compiler.compile(S(choice=[f"c{i}" for i in range(50)]))
    assert compiler.cache_entries == 1  # nothing refused was kept
    with pytest.raises(ValueError, match="nested too deeply"):
        S(json="[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match="must hold one constraint"):
        GrammarLimits(max_bytes=1 << 20, cache_bytes=1 << 20)


def test_closed_objects_at_any_depth_is_iterative() -> None:
    deep = {"type": "integer"}
    for _ in range(5000):
        deep = {"type": "object", "properties": {"a": deep}, "allOf": [{"type": "object"}]}
    closed = _closed_objects(deep)
    node, seen = closed, 0
    while "properties" in node:
        assert node["additionalProperties"] is False and node["allOf"][0]["additionalProperties"] is False
        node, seen = node["properties"]["a"], seen + 1
    assert seen == 5000 and node == {"type": "integer"} and "additionalProperties" not in deep


@pytest.mark.parametrize(
    "params, pattern",
    [
        (S(grammar='start: x\nx: "a" x'), "fails at its first step.*[Tt]oo many items"),  # no base case
        # A rule of 3000 alternatives: llguidance's parser takes at most 2000 items a row, which shows once the
        # tokens their shared prefix forces are in.
        (S(grammar="start: " + " | ".join(f'"opt {i}"' for i in range(3000))), "first step.*3001 items"),
        (S(regex="[^\\x00-\\U0010FFFF]"), "first step: NoExtension"),  # matches no text at all
    ],
)
def test_constraints_failing_at_their_first_step_are_refused(tok, params: S, pattern: str) -> None:
    compiler = GrammarCompiler(tok, TINY_VOCAB, [TINY_EOS])
    with pytest.raises(GrammarError, match=re.compile(pattern, re.S)):
        compiler.compile(params)
    assert compiler.cache_entries == 0


def test_choices_past_the_parser_row_limit_and_sharing_prefixes(tok, compiler: GrammarCompiler) -> None:
    # A rule of 2000 alternatives fails llguidance's parser (at most 2000 items a row) once its first token is in;
    # one terminal of alternatives does not, and still ends exactly at each choice.
    many = compiler.start(S(choice=[f"ab{i}" for i in range(3000)]))
    assert allowed_text(tok, many, ids(tok, "ab")) == set("0123456789")
    assert allowed_text(tok, many, ids(tok, "ab29")) == set("0123456789") | {"EOS"}
    nested = compiler.start(S(choice=["a", "ab", "abc"]))
    assert allowed_text(tok, nested, ids(tok, "a")) == {"b", "EOS"}
    assert allowed_text(tok, nested, ids(tok, "abc")) == {"EOS"}
    prefix = compiler.start(S(choice=["x" * 60 + str(i) for i in range(3000)]))
    assert allowed_text(tok, prefix, ids(tok, "x" * 60)) == set("0123456789")


def test_no_tokenizer_or_eos_is_an_error() -> None:
    with pytest.raises(GrammarError, match="tokenizer"):
        GrammarCompiler(None, 10, [1])


def test_unpack_bitmask_matches_a_bit_loop() -> None:
    gen = torch.Generator().manual_seed(0)
    words = torch.randint(-(2**31), 2**31 - 1, (3, 5), dtype=torch.int32, generator=gen)
    for vocab in (1, 33, 150, 160):
        got = unpack_bitmask(words, vocab)
        want = [[bool((int(words[r, t // 32]) >> (t % 32)) & 1) for t in range(vocab)] for r in range(3)]
        assert got.tolist() == want


def test_real_tokenizer_never_allows_special_tokens_inside_json(embedded_model_dir: Path) -> None:
    # xgrammar lets <|im_start|> and the like into JSON strings (as their text); llguidance does not.
    from lockstep.models.loader import load_tokenizer

    tokenizer = load_tokenizer(str(embedded_model_dir))
    compiler = GrammarCompiler(tokenizer, 49152, [tokenizer.eos_token_id])
    state = compiler.start(S(json={"type": "object", "properties": {"s": {"type": "string"}}}))
    start = token_masks([(state, [], True)], 49152, "cpu")[0].nonzero().flatten().tolist()
    assert start and all(tokenizer.decode([t]).startswith("{") for t in start)
    inside = tokenizer.encode('{"s": "ab', add_special_tokens=False)
    mask = token_masks([(state, inside, True)], 49152, "cpu")[0]
    assert mask.sum() > 40000  # almost any text continues a string
    assert not mask[tokenizer.all_special_ids].any()


def test_perl_classes_are_ascii_as_in_json_schema_and_vllm(embedded_model_dir: Path) -> None:
    # llguidance reads \d as Unicode digits: a byte-level tokenizer then let "🯸" (U+1FBF8) through as a digit.
    from lockstep.models.loader import load_tokenizer

    tokenizer = load_tokenizer(str(embedded_model_dir))
    compiler = GrammarCompiler(tokenizer, 49152, [tokenizer.eos_token_id])
    for regex in (r"\d{3}-\d{4}", r"[\d]{3}-\d{4}"):
        state = compiler.start(S(regex=regex))
        start = token_masks([(state, [], True)], 49152, "cpu")[0].nonzero().flatten().tolist()
        assert start and all(re.fullmatch("[0-9]{1,3}", tokenizer.decode([t])) for t in start), regex
    word = compiler.start(S(regex=r"\w+"))
    allowed = token_masks([(word, [], True)], 49152, "cpu")[0].nonzero().flatten().tolist()
    assert allowed and all(re.fullmatch("[0-9A-Za-z_]+", tokenizer.decode([t])) for t in allowed)

    assert ascii_classes(r"\d{3}-\D\w\W") == "[0-9]{3}-[^0-9][0-9A-Za-z_][^0-9A-Za-z_]"
    assert ascii_classes(r"[\d.][^\d][a\D]") == "[0-9.][^0-9][a[^0-9]]"  # in brackets; negated: a nested class
    assert ascii_classes(r"\\d[]\d][[:alpha:]\w]\p{L}") == r"\\d[]0-9][[:alpha:]0-9A-Za-z_]\p{L}"
