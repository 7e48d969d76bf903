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


class BeamSearch:
    """The search's state for a list of prompts (token ids), advanced one step at a time by whoever runs the
    engine: ``pending()`` is the token ids of every live beam, in order; ``advance(steps)`` takes each one's
    candidates (the ``Logprob`` dict of its one-token request, ``STEP_PARAMS(width)``'s); ``done`` says when no
    beam is left or ``max_tokens`` steps ran; ``outputs(tokenizer)`` is the result."""

    def __init__(
        self, prompts: list[list[int]], params: BeamSearchParams, eos_token_ids: tuple[int, ...], max_model_len: int
    ) -> None:
        self.params, self.max_model_len = params, max_model_len
        self.eos = eos_token_ids[0] if eos_token_ids else None
        self.eos_ids = set() if params.ignore_eos else set(eos_token_ids)
        self.live = [[BeamSearchSequence(list(p), [])] for p in prompts]
        self.finished: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        self.steps = 0
        self._retire_full()

    @property
    def step_params(self) -> SamplingParams:
        """What each beam's one-token request asks for: the raw top ``2 * beam_width`` logprobs."""
        return SamplingParams(max_tokens=1, temperature=0, logprobs=2 * self.params.beam_width, ignore_eos=True)

    @property
    def done(self) -> bool:
        return self.steps >= self.params.max_tokens or not any(self.live)

    def _score(self, beam: BeamSearchSequence) -> float:
        return beam_score(beam, self.eos, self.params.length_penalty)

    def _retire_full(self) -> None:
        # A beam at the context's end cannot grow: it is finished as it is.
        for i, beams in enumerate(self.live):
            self.finished[i] += [b for b in beams if len(b.tokens) >= self.max_model_len]
            self.live[i] = [b for b in beams if len(b.tokens) < self.max_model_len]

    def pending(self) -> list[list[int]]:
        return [b.tokens for beams in self.live for b in beams]

    def advance(self, steps: list[dict[int, Logprob]]) -> None:
        k = 0
        for i, beams in enumerate(self.live):
            grown = []
            for beam in beams:
                step = steps[k]
                k += 1
                # The candidates in rank order (the dict holds the sampled token first, then the top 2k).
                for token, lp in sorted(step.items(), key=lambda item: item[1].rank):
                    new = BeamSearchSequence(
                        beam.tokens + [token], beam.logprobs + [step], beam.cum_logprob + lp.logprob
                    )
                    if token in self.eos_ids:
                        new.finish_reason = "stop"
                        self.finished[i].append(new)
                    else:
                        grown.append(new)
            self.live[i] = sorted(grown, key=self._score, reverse=True)[: self.params.beam_width]
        if k != len(steps):
            raise ValueError(f"{len(steps)} steps for {k} live beams")
        self.steps += 1
        self._retire_full()

    def outputs(self, tokenizer) -> list[BeamSearchOutput]:
        result = []
        for finished, live in zip(self.finished, self.live, strict=True):
            for beam in live:
                beam.finish_reason = beam.finish_reason or "length"
            best = sorted(finished + live, key=self._score, reverse=True)[: self.params.beam_width]
            for beam in best:
                beam.text = tokenizer.decode(beam.tokens) if tokenizer is not None else None
            result.append(BeamSearchOutput(best))
        return result


def beam_search(llm, prompts: list[list[int]], params: BeamSearchParams, use_tqdm: bool = False) -> list:
    """``BeamSearchOutput`` for each prompt (token ids), in order; ``llm`` is the ``LLM`` whose engine runs it."""
    engine = llm.engine
    search = BeamSearch(prompts, params, engine.eos_token_ids, engine.max_model_len)
    bar = None
    if use_tqdm:
        from tqdm.auto import tqdm

        bar = tqdm(total=params.max_tokens, desc="Beam search", unit="token")
    while not search.done:
        outs = llm._generate([(None, ids, None) for ids in search.pending()], search.step_params, use_tqdm=False)
        search.advance([out.outputs[0].logprobs[0] for out in outs])
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return search.outputs(engine.tokenizer)
