"""vLLM's offline beam search (``LLM.beam_search``), on lockstep's engine.

Each step runs every live beam of every prompt as a one-token request asking for the top ``2 * beam_width``
logprobs (``SamplingParams(max_tokens=1, temperature=0, logprobs=2k)``), extends each beam by each candidate
token (its score the beam's summed logprob plus the token's), moves beams that end in EOS to the finished ones
(unless ``ignore_eos``), and keeps each prompt's ``beam_width`` best by score. After ``max_tokens`` steps (or when
no beam is left) the finished and the live beams are ranked together and the best ``beam_width`` returned.

Why it is batch-invariant: every beam's logprobs are a request's logprobs, which the engine's contract makes the
same bits whatever else runs in its step (other beams, other prompts, other callers), after a prefix-cache hit
(each step's request reuses the beam's cached blocks) or a preemption. The candidates of a beam are exact (a stable
sort of one row, ties to the lower id); the scores are the same fp64 sums in the same order; the ranking is a
stable sort whose ties keep the candidates' order (beams in order, each beam's tokens by rank). So the beams are a
pure function of the prompt and the parameters.
"""

from dataclasses import dataclass

from lockstep.outputs import Logprob
from lockstep.sampling_params import BeamSearchParams, SamplingParams


@dataclass
class BeamSearchSequence:
    """One beam (vLLM's): ``tokens`` holds the prompt's and the generated ones, ``logprobs`` the candidates' dicts
    of each generated step, ``cum_logprob`` the generated tokens' summed logprob (in order); ``text`` is the whole
    sequence decoded; ``finish_reason`` "stop" (EOS) or "length"."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """A prompt's best sequences, best first (vLLM's): at most ``beam_width``."""

    sequences: list[BeamSearchSequence]


def beam_score(beam: BeamSearchSequence, eos_token_id: int | None, length_penalty: float) -> float:
    """vLLM's score: ``cum_logprob / len ** length_penalty``, the length counting the prompt but not a final EOS."""
    length = len(beam.tokens) - (1 if eos_token_id is not None and beam.tokens[-1] == eos_token_id else 0)
    return beam.cum_logprob / (length**length_penalty)


def beam_search(llm, prompts: list[list[int]], params: BeamSearchParams, use_tqdm: bool = False) -> list:
    """``BeamSearchOutput`` for each prompt (token ids), in order; ``llm`` is the ``LLM`` whose engine runs it."""
    engine = llm.engine
    width = params.beam_width
    eos = engine.eos_token_ids[0] if engine.eos_token_ids else None
    eos_ids = set() if params.ignore_eos else set(engine.eos_token_ids)
    step_params = SamplingParams(max_tokens=1, temperature=0, logprobs=2 * width, ignore_eos=True)

    def score(beam: BeamSearchSequence) -> float:
        return beam_score(beam, eos, params.length_penalty)

    live = [[BeamSearchSequence(list(p), [])] for p in prompts]
    done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
    steps = range(params.max_tokens)
    if use_tqdm:
        from tqdm.auto import tqdm

        steps = tqdm(steps, desc="Beam search", unit="token")
    for _ in steps:
        for i, beams in enumerate(live):  # a beam at the context's end cannot grow: it is done
            done[i] += [b for b in beams if len(b.tokens) >= engine.max_model_len]
            live[i] = [b for b in beams if len(b.tokens) < engine.max_model_len]
        flat = [b for beams in live for b in beams]
        if not flat:
            break
        outs = llm._generate([(None, b.tokens, None) for b in flat], step_params, use_tqdm=False)
        k = 0
        for i, beams in enumerate(live):
            grown = []
            for beam in beams:
                step = outs[k].outputs[0].logprobs[0]
                k += 1
                # The candidates in rank order (the dict holds the sampled token first, then the top 2k).
                for token, lp in sorted(step.items(), key=lambda item: item[1].rank):
                    new = BeamSearchSequence(
                        beam.tokens + [token], beam.logprobs + [step], beam.cum_logprob + lp.logprob
                    )
                    if token in eos_ids:
                        new.finish_reason = "stop"
                        done[i].append(new)
                    else:
                        grown.append(new)
            live[i] = sorted(grown, key=score, reverse=True)[:width]
    tokenizer = engine.tokenizer
    outputs = []
    for i in range(len(prompts)):
        for beam in live[i]:
            beam.finish_reason = beam.finish_reason or "length"
        best = sorted(done[i] + live[i], key=score, reverse=True)[:width]
        for beam in best:
            beam.text = tokenizer.decode(beam.tokens) if tokenizer is not None else None
        outputs.append(BeamSearchOutput(best))
    return outputs
