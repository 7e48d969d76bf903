"""The auditor's analysis, with a negative control: it must see differences that are there."""

from pathlib import Path

from lockstep.audit.report import Sample, analyze, distinct_prefixes, plot, summary_lines


def test_distinct_prefixes() -> None:
    seqs = [list("abcd"), list("abcd"), list("abxy"), list("ab"), list("abxz")]
    # Position 2: "abc", "abx", "ab"+end -> 3; position 3: "abcd", "abxy", "ab", "abxz" -> 4.
    assert distinct_prefixes(seqs) == [1, 1, 3, 4]
    assert distinct_prefixes([]) == []


def test_analyze_sees_a_split_and_logprob_differences() -> None:
    a = Sample("New York City", ["New", " York", " City"], [-0.1, -0.2, -0.3], "stop")
    b = Sample("New York, Queens", ["New", " York", ",", " Queens"], [-0.1, -0.25, -1.0, -2.0], "stop")
    c = Sample("New York City", ["New", " York", " City"], [-0.1, -0.2, -0.3], "stop")
    rep = analyze([a, b, c, Sample(error="APIError: boom")])
    assert (rep["requests"], rep["errors"], rep["unique_completions"]) == (4, 1, 2)
    assert abs(rep["most_common_share"] - 2 / 3) < 1e-12
    assert rep["first_divergence_position"] == 2 and rep["unit"] == "token"
    assert rep["competing_continuations"] == [
        {"continuation": " City", "count": 2},
        {"continuation": ", Queens", "count": 1},
    ]
    lp = rep["logprobs"]
    assert lp["first_difference_position"] == 1 and abs(lp["max_abs_difference"] - 0.05) < 1e-12
    assert not lp["bitwise_identical"]
    assert "first divergence at token 2" in "\n".join(summary_lines("x", rep))


def test_analyze_identical_texts_with_different_logprobs() -> None:
    a = Sample("ok", ["o", "k"], [-0.5, -0.25])
    b = Sample("ok", ["o", "k"], [-0.5, -0.2500001])
    rep = analyze([a, b])
    assert rep["unique_completions"] == 1 and rep["first_divergence_position"] is None
    assert rep["logprobs"]["first_difference_position"] == 1
    assert rep["logprobs"]["distinct_logprob_sequences_per_text"] == 2


def test_analyze_without_logprobs_uses_characters(tmp_path: Path) -> None:
    rep = analyze([Sample("abc"), Sample("abd")])
    assert rep["unit"] == "char" and rep["first_divergence_position"] == 2 and "logprobs" not in rep
    plot({"panel": {"1": rep}}, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 1000
