"""Next-token choice for every sequence of a step at once: vLLM's sampler, batched on the logits tensor.

One call takes the step's logit rows (one per sequence that completes) and, on tensors of those
rows: takes the raw log-probabilities the requests asked for, applies the logits processors
(min_tokens, logit_bias, penalties from per-sequence token counts, grammar masks;
logits_processors.py, grammar.py), then picks: greedy rows the argmax, sampled rows the
temperature, min_p, top_k and top_p, and a draw. A row none of that applies to is left as the
model gave it, so a greedy request with no processors takes the plain argmax whoever shares its
batch; a request never reads another row.

A draw takes one uniform number per row and the token where it falls in the row's cumulative
distribution (inverse CDF). vLLM's GPU sampler races Exp(1) noise over every token instead; on a
CPU that is one random number per vocabulary entry (49152 for smollm2) per row per step, which cost
more than the rest of a 64-sequence step's sampling together. A seeded sequence draws from a
`torch.Generator` of its own, kept here until the sequence ends: each generated token draws once
from it, so a sequence that is preempted and resumed continues the same random stream. Unseeded
rows share one generator seeded by the OS. Grammar matchers are kept
the same way and advance only with the tokens chosen.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtier.engine import logits_processors as processors
from kvtier.engine.grammar import Matcher, apply_masks
from kvtier.engine.logprobs import TokenLogprobs, raw_logprobs, token_logprobs
from kvtier.engine.sequence import Sequence


@dataclass(frozen=True)
class Sampled:
    """A step's choices: one token per row, and its log-probabilities where the row's sampling wants them."""

    tokens: list[int]
    logprobs: list[TokenLogprobs | None]


class Sampler:
    """Chooses tokens from logit rows; holds the generators and grammar matchers of the sequences it has seen."""

    def __init__(self, eos_token_ids: tuple[int, ...] = ()) -> None:
        """`eos_token_ids`: what min_tokens holds back (with each sequence's stop_token_ids)."""
        self._eos = tuple(eos_token_ids)
        self._generators: dict[int, torch.Generator] = {}
        self._matchers: dict[int, Matcher] = {}
        self._prompts: dict[int, torch.Tensor] = {}  # prompt ids as a tensor, made once per sequence
        self._dead: set[int] = set()  # sequences whose grammar allowed no token
        self._shared = torch.Generator(device="cpu")
        self._shared.seed()

    def choose(self, logits: torch.Tensor, seqs: list[Sequence]) -> Sampled:
        """One token for each row of `logits` [n, vocab]: row i is `seqs[i]`'s next-token logits."""
        wanted = [row for row, seq in enumerate(seqs) if seq.sampling.wants_logprob]
        raw = raw_logprobs(logits[wanted]) if wanted else None
        if all(seq.sampling.greedy and not _processed(seq) for seq in seqs):
            tokens = logits.argmax(dim=-1).tolist()
        else:
            logits = logits.to(torch.float32, copy=True)  # processed in place; the caller's rows stay as they were
            self._process(logits, seqs)
            tokens = self._pick(logits, seqs)
        self._advance_grammars(seqs, tokens)
        return Sampled(tokens, self._logprobs(raw, wanted, seqs, tokens))

    def grammar_end(self, seq: Sequence) -> str | None:
        """How `seq`'s last token left its grammar: "stop" when it completed it, "error" when the grammar allowed no
        token at all (the token drawn is outside it), None while the grammar goes on (or it has none)."""
        if seq.request_id in self._dead:
            return "error"
        matcher = self._matchers.get(seq.request_id)
        return "stop" if matcher is not None and matcher.complete else None

    def forget(self, request_id: int) -> None:
        """The sequence ended: drop its generator, matcher and prompt tensor."""
        for state in (self._generators, self._matchers, self._prompts):
            state.pop(request_id, None)
        self._dead.discard(request_id)

    # ----- logits processors -----

    def _process(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """Apply every row's processors to `logits` in place."""
        held, biased = self._suppressed(seqs), self._biases(seqs)
        processors.suppress(logits, *held)
        processors.add_bias(logits, *biased)
        penalized = [row for row, seq in enumerate(seqs) if seq.sampling.penalized]
        if penalized:
            chosen = [seqs[row] for row in penalized]
            processors.penalize(logits, penalized, [self._prompt(seq) for seq in chosen],
                                [torch.tensor(seq.output_ids, dtype=torch.long) for seq in chosen],
                                *([getattr(seq.sampling, name) for seq in chosen]
                                  for name in ("repetition_penalty", "presence_penalty", "frequency_penalty")))
        constrained = [row for row, seq in enumerate(seqs) if seq.sampling.grammar is not None]
        apply_masks(logits, constrained, [self._matcher(seqs[row]) for row in constrained])

    def _suppressed(self, seqs: list[Sequence]) -> tuple[list[int], list[int]]:
        """(rows, tokens): the stop tokens of sequences still short of their min_tokens."""
        rows, tokens = [], []
        for row, seq in enumerate(seqs):
            if len(seq.output_ids) < seq.sampling.min_tokens:
                stops = set(seq.sampling.stop_token_ids) | (set() if seq.sampling.ignore_eos else set(self._eos))
                rows += [row] * len(stops)
                tokens += sorted(stops)
        return rows, tokens

    @staticmethod
    def _biases(seqs: list[Sequence]) -> tuple[list[int], list[int], list[float]]:
        rows, tokens, biases = [], [], []
        for row, seq in enumerate(seqs):
            for token, bias in seq.sampling.logit_bias.items():
                rows.append(row)
                tokens.append(token)
                biases.append(bias)
        return rows, tokens, biases

    # ----- picking -----

    def _pick(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        tokens = logits.argmax(dim=-1)  # the greedy rows' choice; sampled rows are overwritten
        sampled = [row for row, seq in enumerate(seqs) if not seq.sampling.greedy]
        if sampled:
            tokens[torch.tensor(sampled)] = self._draw(logits[sampled], [seqs[row] for row in sampled])
        return tokens.tolist()

    def _draw(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """One token per row drawn from the row's softmax at its temperature, within its min_p, top_k and top_p."""
        params = [seq.sampling for seq in seqs]
        logits /= torch.tensor([p.temperature for p in params])[:, None]
        uniforms = self._uniforms(seqs)
        tokens = torch.empty(len(seqs), dtype=torch.long)
        for rows in ([i for i, p in enumerate(params) if p.top_k > 0], [i for i, p in enumerate(params) if p.top_k <= 0]):
            if not rows:
                continue
            limits = [torch.tensor([getattr(params[i], name) for i in rows]) for name in ("min_p", "top_p")]
            if params[rows[0]].top_k > 0:
                top_k = torch.tensor([params[i].top_k for i in rows])
                tokens[rows] = processors.draw_top_k(logits[rows], top_k, *limits, uniforms[rows])
            else:
                tokens[rows] = processors.draw(logits[rows], *limits, uniforms[rows])
        return tokens

    def _uniforms(self, seqs: list[Sequence]) -> torch.Tensor:
        """One U[0, 1) per row, each seeded row's from its own generator, the other rows' from the shared one."""
        points = torch.rand(len(seqs), generator=self._shared)
        for row, seq in enumerate(seqs):
            if seq.sampling.seed is not None:
                points[row] = torch.rand(1, generator=self._generator(seq))[0]
        return points

    def _generator(self, seq: Sequence) -> torch.Generator:
        generator = self._generators.get(seq.request_id)
        if generator is None:
            generator = self._generators[seq.request_id] = torch.Generator(device="cpu")
            generator.manual_seed(seq.sampling.seed)
        return generator

    # ----- per-sequence state -----

    def _prompt(self, seq: Sequence) -> torch.Tensor:
        prompt = self._prompts.get(seq.request_id)
        if prompt is None:
            prompt = self._prompts[seq.request_id] = torch.tensor(seq.prompt_ids, dtype=torch.long)
        return prompt

    def _matcher(self, seq: Sequence) -> Matcher:
        matcher = self._matchers.get(seq.request_id)
        if matcher is None:
            matcher = self._matchers[seq.request_id] = seq.sampling.grammar.matcher()
        return matcher

    def _advance_grammars(self, seqs: list[Sequence], tokens: list[int]) -> None:
        for seq, token in zip(seqs, tokens):
            if seq.sampling.grammar is not None and not self._matcher(seq).accept(token):
                self._dead.add(seq.request_id)  # its row was all -inf: the sequence ends (one request, not the step)

    @staticmethod
    def _logprobs(raw: torch.Tensor | None, wanted: list[int], seqs: list[Sequence],
                  tokens: list[int]) -> list[TokenLogprobs | None]:
        found: list[TokenLogprobs | None] = [None] * len(seqs)
        if raw is not None:
            tops = [seqs[row].sampling.logprobs or 0 for row in wanted]
            for row, entry in zip(wanted, token_logprobs(raw, [tokens[row] for row in wanted], tops)):
                found[row] = entry
        return found


def _processed(seq: Sequence) -> bool:
    """Whether a logits processor changes `seq`'s row this step."""
    sampling = seq.sampling
    return (sampling.penalized or bool(sampling.logit_bias) or sampling.grammar is not None
            or len(seq.output_ids) < sampling.min_tokens)
