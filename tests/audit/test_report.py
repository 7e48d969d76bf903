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


def _plotted(fig, row: int) -> dict[str, list[float]]:
    """The plotted series of the figure's ``row`` (one column here), by legend label."""
    ax = fig.axes[row]
    return {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()}


def test_logprob_panels_see_equal_texts_with_different_logprobs(tmp_path: Path) -> None:
    import matplotlib.pyplot as plt

    from lockstep.audit.report import figure, logprob_spread

    same = [Sample("ok!", ["o", "k", "!"], [-0.5, -0.25, -1.0]) for _ in range(3)]
    drift = [
        Sample("ok!", ["o", "k", "!"], [-0.5, -0.25, -1.0]),
        Sample("ok!", ["o", "k", "!"], [-0.5, -0.2500001, -1.0]),
        Sample("ok!", ["o", "k", "!"], [-0.5, -0.2500002, -1.5]),
    ]
    assert logprob_spread(same) == ([1, 1, 1], [0.0, 0.0, 0.0])
    distinct, spread = logprob_spread(drift)
    assert distinct == [1, 3, 2] and spread[0] == 0.0 and abs(spread[1] - 2e-7) < 1e-12 and spread[2] == 0.5
    # Texts that split are compared only within a group that chose the same tokens: a deterministic split is 1 / 0.
    split = [Sample("ab", ["a", "b"], [-0.1, -0.2]), Sample("ac", ["a", "c"], [-0.1, -0.3])]
    assert logprob_spread(split) == ([1, 1], [0.0, 0.0])
    assert logprob_spread(split + [Sample("ab", ["a", "b"], [-0.1, -0.4])]) == ([1, 2], [0.0, 0.2])
    # The report carries the series and the figure plots them: texts agree (row 1 flat at 1), logprobs do not.
    reps = {"1": analyze(same), "8": analyze(drift)}
    assert reps["8"]["distinct_prefixes"] == [1, 1, 1] and reps["8"]["distinct_logprobs"] == [1, 3, 2]
    fig = figure({"endpoint": reps})
    prefixes, values, diffs = (_plotted(fig, row) for row in range(3))
    assert all(ys == [1, 1, 1] for ys in prefixes.values()) and len(prefixes) == 2
    [steady] = [ys for label, ys in values.items() if label.startswith("concurrency 1:")]
    [drifting] = [ys for label, ys in values.items() if label.startswith("concurrency 8:")]
    assert steady == [1, 1, 1] and max(drifting) == 3
    [steady] = [ys for label, ys in diffs.items() if label.startswith("concurrency 1:")]
    [drifting] = [ys for label, ys in diffs.items() if label.startswith("concurrency 8:")]
    assert steady == [0.0, 0.0, 0.0] and max(drifting) == 0.5
    assert fig.axes[2].get_yscale() == "symlog"
    colours = [{line.get_color() for line in fig.axes[row].get_lines()} for row in range(3)]
    assert colours[0] == colours[1] == colours[2] and len(colours[0]) == 2  # a level keeps its colour
    plt.close(fig)
    plot({"endpoint": reps}, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 1000
