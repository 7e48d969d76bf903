"""What the auditor concludes from many completions of one request: how many differ, where they split, and
how their logprobs differ; the JSON report, the text summary and the plot: distinct prefixes per position, and
where the samples carry logprobs, per position the distinct logprob values and their spread among samples that
agree so far (texts that agree can still carry logprobs that do not)."""

from collections import Counter
from dataclasses import dataclass

CONTINUATION_UNITS = 8  # how many tokens of each competing continuation the report shows
TOP_CONTINUATIONS = 5


@dataclass
class Sample:
    """One completion. ``tokens`` and ``logprobs`` are None when the endpoint returned no logprobs."""

    text: str = ""
    tokens: list[str] | None = None
    logprobs: list[float] | None = None
    finish_reason: str | None = None
    fingerprint: str | None = None
    error: str | None = None


def _units(samples: list[Sample]) -> tuple[list[list[str]], str]:
    if samples and all(s.tokens is not None for s in samples):
        return [list(s.tokens) for s in samples], "token"
    return [list(s.text) for s in samples], "char"


def distinct_prefixes(seqs: list[list[str]]) -> list[int]:
    """``out[p]`` = how many distinct prefixes of length ``p + 1`` the sequences have (a finished sequence
    counts as its own prefix from there on). One pass per position: each sequence carries the id of its
    prefix class, and a class splits by the next unit."""
    length = max((len(s) for s in seqs), default=0)
    ids = [0] * len(seqs)
    out = []
    for p in range(length):
        classes: dict[tuple, int] = {}
        for i, s in enumerate(seqs):
            key = (ids[i], s[p] if p < len(s) else None)
            ids[i] = classes.setdefault(key, len(classes))
        out.append(len(classes))
    return out


def logprob_spread(samples: list[Sample]) -> tuple[list[int], list[float]]:
    """Per position ``p``, over the samples that have the same tokens through ``p``: the most distinct logprob
    values one such group carries at ``p`` and the largest max - min within a group. Samples that chose other
    tokens are not compared with each other (their logprobs are of different tokens); a bitwise-deterministic
    endpoint gives 1 and 0.0 at every position whatever its texts do. The classes are ``distinct_prefixes``'."""
    seqs = [(s.tokens, s.logprobs) for s in samples if s.tokens is not None and s.logprobs is not None]
    length = max((min(len(t), len(lp)) for t, lp in seqs), default=0)
    ids = [0] * len(seqs)
    distinct, spread = [], []
    for p in range(length):
        classes: dict[tuple, int] = {}
        values: dict[int, list[float]] = {}
        for i, (tokens, lps) in enumerate(seqs):
            if p >= min(len(tokens), len(lps)):
                ids[i] = -1  # ended: out of every later group
                continue
            ids[i] = classes.setdefault((ids[i], tokens[p]), len(classes))
            values.setdefault(ids[i], []).append(lps[p])
        distinct.append(max(len(set(v)) for v in values.values()))
        spread.append(max(max(v) - min(v) for v in values.values()))
    return distinct, spread


def analyze(samples: list[Sample]) -> dict:
    """Summary of one batch of completions of the same request."""
    ok = [s for s in samples if s.error is None]
    errors = Counter(s.error for s in samples if s.error is not None)
    report: dict = {"requests": len(samples), "errors": len(samples) - len(ok)}
    if errors:
        report["error_examples"] = [{"error": e[:300], "count": c} for e, c in errors.most_common(3)]
    if not ok:
        return report | {"unique_completions": 0}
    counts = Counter(s.text for s in ok)
    top_text, top_count = counts.most_common(1)[0]
    seqs, unit = _units(ok)
    prefixes = distinct_prefixes(seqs)
    split = next((p for p, k in enumerate(prefixes) if k > 1), None)
    report |= {
        "unique_completions": len(counts),
        "most_common_share": top_count / len(ok),
        "most_common_completion": top_text,
        "completions": [{"text": t, "count": c} for t, c in counts.most_common(10)],
        "unit": unit,
        "first_divergence_position": split,
        "distinct_prefixes": prefixes,
        "finish_reasons": dict(Counter(str(s.finish_reason) for s in ok)),
        "system_fingerprints": sorted({s.fingerprint for s in ok if s.fingerprint}),
    }
    if split is not None:
        shared = "".join(seqs[0][:split])
        cont = Counter("".join(s[split : split + CONTINUATION_UNITS]) or "<end>" for s in seqs)
        report["shared_prefix"] = shared[-200:]
        report["competing_continuations"] = [
            {"continuation": t, "count": c} for t, c in cont.most_common(TOP_CONTINUATIONS)
        ]
    with_lp = [s for s in ok if s.logprobs is not None]
    if with_lp:
        report["logprobs"] = _logprob_differences(with_lp, split)
        distinct, spread = logprob_spread(with_lp)
        report["distinct_logprobs"], report["max_logprob_diff"] = distinct, spread
    return report


def _logprob_differences(samples: list[Sample], split: int | None) -> dict:
    """Over the positions every completion shares (before the first divergence), where the logprobs first
    differ and by how much at most; and how many distinct logprob sequences the identical texts carry."""
    end = min(len(s.logprobs) for s in samples)
    if split is not None:
        end = min(end, split)
    first, worst = None, 0.0
    for p in range(end):
        values = [s.logprobs[p] for s in samples]
        spread = max(values) - min(values)
        if spread > 0 and first is None:
            first = p
        worst = max(worst, spread)
    by_text: dict[str, set] = {}
    for s in samples:
        by_text.setdefault(s.text, set()).add(tuple(s.logprobs))
    return {
        "compared_positions": end,
        "first_difference_position": first,
        "max_abs_difference": worst,
        "bitwise_identical": first is None,
        "distinct_logprob_sequences_per_text": max(len(v) for v in by_text.values()),
    }


def summary_lines(label: str, report: dict) -> list[str]:
    if not report.get("unique_completions"):
        return [f"{label}: {report['requests']} requests, {report['errors']} errors, no completions"]
    line = (
        f"{label}: {report['requests']} requests, {report['errors']} errors, "
        f"{report['unique_completions']} unique completion(s), most common {report['most_common_share']:.1%}"
    )
    lines = [line]
    split = report["first_divergence_position"]
    if split is not None:
        conts = ", ".join(f"{c['continuation']!r} x{c['count']}" for c in report["competing_continuations"])
        lines.append(f"    first divergence at {report['unit']} {split}: {conts}")
    lp = report.get("logprobs")
    if lp is not None:
        if lp["bitwise_identical"]:
            lines.append(f"    logprobs bitwise identical over {lp['compared_positions']} shared positions")
        else:
            lines.append(
                f"    logprobs differ from position {lp['first_difference_position']}, "
                f"max |diff| {lp['max_abs_difference']:.3g}"
            )
    return lines


def figure(panels: dict[str, dict[str, dict]]):
    """One column per experiment (``panels[title][level] = analysis``), one colour per level. Row 1: distinct
    prefixes per position. Where any level has logprobs, row 2: the most distinct logprob values at a position
    among samples with the same tokens so far (1 = bitwise equal), row 3: their max |diff| (symlog, so 0 shows)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with_lp = any("distinct_logprobs" in rep for levels in panels.values() for rep in levels.values())
    rows = 3 if with_lp else 1
    fig, axes = plt.subplots(rows, len(panels), figsize=(6.5 * len(panels), 3.6 * rows), squeeze=False)
    for col, (title, levels) in enumerate(panels.items()):
        for k, (level, rep) in enumerate(levels.items()):
            colour = f"C{k % 10}"
            ys = rep.get("distinct_prefixes") or [0]
            label = f"concurrency {level}: {rep.get('unique_completions', 0)} unique"
            axes[0][col].step(range(len(ys)), ys, where="post", label=label, color=colour)
            if with_lp and "distinct_logprobs" in rep:
                lp = rep.get("logprobs") or {}
                worst = lp.get("max_abs_difference", 0.0)
                label = f"concurrency {level}: max |diff| {worst:.3g}"
                ys = rep["distinct_logprobs"] or [0]
                axes[1][col].step(range(len(ys)), ys, where="post", label=label, color=colour)
                ys = rep["max_logprob_diff"] or [0.0]
                axes[2][col].step(range(len(ys)), ys, where="post", label=label, color=colour)
        axes[0][col].set_title(title)
        axes[0][col].set_ylabel("distinct prefixes")
        if with_lp:
            axes[1][col].set_ylabel("distinct logprob values\n(same tokens so far)")
            axes[2][col].set_ylabel("max |logprob diff|\n(same tokens so far)")
            axes[2][col].set_yscale("symlog", linthresh=1e-9)
        for ax in axes[:, col]:
            ax.set_xlabel("position (tokens, or characters without logprobs)")
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot(panels: dict[str, dict[str, dict]], path: str) -> None:
    """``figure(panels)``, written to ``path`` as a PNG."""
    import matplotlib.pyplot as plt

    fig = figure(panels)
    fig.savefig(path, dpi=120)
    plt.close(fig)
