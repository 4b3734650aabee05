"""Turning logits into the next token.

Order of operations (each documented where the sampler tests check it):

1. ``logit_bias`` is added to the raw logits;
2. repetition penalty (multiplicative, over prompt + output in the penalty window): a positive
   logit is divided by it, a negative one multiplied;
3. frequency penalty (subtracted once per occurrence in the output window) and presence penalty
   (subtracted once for every token present in the output window);
4. temperature below :data:`GREEDY_BELOW` (0 included) → argmax of the above; otherwise divide by
   the temperature, then keep the ``top_k`` largest, the smallest set whose probability reaches
   ``top_p`` (never empty: the most likely token stays), and the tokens whose probability is at
   least ``min_p`` times the largest; sample with the request's own generator. A logit that the
   penalties or the temperature push past float32's range is held at its largest value, and a
   repetition penalty beyond float32's range at its nearest end (so a ``-inf`` logit, e.g. one a
   grammar rules out, stays ``-inf``).

Logprobs are those of the model's raw distribution (``log_softmax`` of the logits before any of
the above), like OpenAI's API.

A sampler works on one device, the one its generator lives on: logits handed to it from anywhere (a
prefix-cache snapshot's host copy, say) are moved there first, so a draw never mixes devices and a
seeded request draws the same numbers whether or not its prompt was cached.
"""

from __future__ import annotations

import torch

from .request import SamplingParams, TokenLogprob

GREEDY_BELOW = 1e-5  # temperatures below this are greedy (as in vLLM): the logits over them leave float32
_FLOAT32_MAX = torch.finfo(torch.float32).max
_FLOAT32_TINY = torch.finfo(torch.float32).tiny


class Sampler:
    """Per-request sampling state: the parameters and a private random generator on ``device`` (where the
    engine's logits land); every tensor it is given is read on that device."""

    def __init__(self, params: SamplingParams, vocab_size: int, device: torch.device | str = "cpu"):
        self.params = params
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()
        self._bias = None
        if params.logit_bias:
            ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=self.device)
            vals = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32, device=self.device)
            self._bias = (ids, vals)

    @property
    def greedy(self) -> bool:
        return self.params.temperature < GREEDY_BELOW

    def adjusted(self, logits: torch.Tensor, prompt: list[int], output: list[int]) -> torch.Tensor:
        """Steps 1-3: bias and penalties applied to float32 ``logits [V]``."""
        p = self.params
        x = logits.to(self.device, torch.float32, copy=True)
        if self._bias is not None:
            x.index_add_(0, self._bias[0], self._bias[1])
        window = p.penalty_window
        if p.repetition_penalty != 1.0:
            history = prompt + output
            seen = _unique(history[-window:] if window else history, self.device)
            if seen.numel():
                vals = x[seen]
                penalty = min(
                    max(p.repetition_penalty, _FLOAT32_TINY), _FLOAT32_MAX
                )  # never a factor of 0 or inf
                x[seen] = torch.where(vals > 0, vals / penalty, vals * penalty).clamp_(max=_FLOAT32_MAX)
        if p.frequency_penalty or p.presence_penalty:
            recent = output[-window:] if window else output
            if recent:
                ids = torch.tensor(recent, dtype=torch.long, device=self.device)
                counts = torch.bincount(ids, minlength=x.shape[0]).float()
                x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
        return x

    def distribution(self, logits: torch.Tensor, prompt: list[int], output: list[int]) -> torch.Tensor:
        """The exact probabilities the sampler draws from (one-hot when greedy)."""
        x = self.adjusted(logits, prompt, output)
        if self.greedy:
            return torch.nn.functional.one_hot(x.argmax(), x.shape[0]).float()
        return _filtered_probs((x / self.params.temperature).clamp_(max=_FLOAT32_MAX), self.params)

    def sample(self, logits: torch.Tensor, prompt: list[int], output: list[int]) -> int:
        if self.greedy:
            return int(self.adjusted(logits, prompt, output).argmax())
        probs = self.distribution(logits, prompt, output)
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def draw(self, probs: torch.Tensor) -> int:
        """Draw from an explicit distribution with this request's generator."""
        return int(torch.multinomial(probs.to(self.device), 1, generator=self.generator))

    def uniform(self) -> float:
        return float(torch.rand((), generator=self.generator, device=self.device))

    def logprob(self, logits: torch.Tensor, token: int) -> TokenLogprob:
        lp = torch.log_softmax(logits.float(), dim=-1)
        entry = TokenLogprob(token=token, logprob=float(lp[token]))
        n = self.params.logprobs or 0
        if n:
            vals, ids = lp.topk(n)
            entry.top = [(int(i), float(v)) for i, v in zip(ids, vals)]
        return entry


def _unique(ids: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(sorted(set(ids)), dtype=torch.long, device=device)


def _filtered_probs(x: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    if p.top_k and p.top_k < x.shape[0]:
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if p.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        before = sorted_p.cumsum(0) - sorted_p  # mass strictly before each token
        drop = before >= p.top_p
        drop[0] = False  # a top_p below float32's smallest number compares as 0 there
        probs = probs.scatter(0, order, sorted_p.masked_fill(drop, 0.0))
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs / probs.sum()
