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
   least ``min_p`` times the largest; sample with the request's counter-based stream (below). A logit that the
   penalties or the temperature push past float32's range is held at its largest value, and a
   repetition penalty beyond float32's range at its nearest end (so a ``-inf`` logit, e.g. one a
   grammar rules out, stays ``-inf``).

Logprobs are those of the model's raw distribution (``log_softmax`` of the logits before any of
the above), like OpenAI's API.

Randomness is counter-based: every random number a request uses is a pure function of its seed, the
output token index it decides and the :class:`Stream` it serves (:func:`counter_key`), never of how many
numbers were drawn before. So a seeded request gives the same tokens however it is batched, whether its
prompt was restored from a snapshot, and whatever a speculative step drew for earlier rows. A request
without a seed draws one 64-bit seed from the OS at construction, so unseeded requests stay independent.

A sampler works on one device, the one its generator lives on: logits handed to it from anywhere (a
prefix-cache snapshot's host copy, say) are moved there first, so a draw never mixes devices.
"""

from __future__ import annotations

import math
import secrets
from enum import IntEnum

import torch

from .. import kernels
from .request import SamplingParams, TokenLogprob

NO_TOKEN = -1  # a device draw from no distribution (NaN, infinity or no mass): its reader raises
GREEDY_BELOW = 1e-5  # temperatures below this are greedy (as in vLLM): the logits over them leave float32
_FLOAT32_MAX = torch.finfo(torch.float32).max
_FLOAT32_TINY = torch.finfo(torch.float32).tiny
_MASK64 = (1 << 64) - 1


class Stream(IntEnum):
    """What a random number decides; each stream has its own numbers for every token index."""

    SAMPLE = 1  # the token drawn from the request's own distribution
    DRAFT = 2  # a draft model's sampled proposal for the token
    ACCEPT = 3  # the speculative test that accepts or rejects a draft of the token
    RESIDUAL = 4  # the token drawn from the residual distribution after a rejected draft


def splitmix64(x: int) -> int:
    """SplitMix64 (Steele, Lea and Flood, 2014) as a mixing function: the golden-ratio increment, then
    two xor-shift-multiply rounds and a final xor-shift, all modulo 2**64. A bijection on 64-bit integers
    in which flipping one input bit flips about half of the output bits."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def counter_key(seed: int, index: int, stream: Stream) -> int:
    """The 64-bit key of the random number that ``stream`` uses for output token ``index`` (>= 0) of a request
    seeded ``seed`` (taken modulo 2**64): ``splitmix64(splitmix64(splitmix64(seed) ^ index) ^ stream)``.

    Every step is a bijection, so with any two of the three fixed, distinct values of the third give
    distinct keys; the mixing spreads them over all 64 bits."""
    return splitmix64(splitmix64(splitmix64(seed & _MASK64) ^ index) ^ stream)


class Sampler:
    """Per-request sampling state: the parameters, the request's seed (``params.seed``, else 64 random bits
    from the OS) and a generator on ``device`` (where the engine's logits land) that each draw reseeds
    with its :func:`counter_key`; every tensor it is given is read on that device."""

    def __init__(self, params: SamplingParams, vocab_size: int, device: torch.device | str = "cpu"):
        self.params = params
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.seed = secrets.randbits(64) if params.seed is None else params.seed & _MASK64
        self._generator = torch.Generator(device=self.device)
        self._bias = None
        if params.logit_bias:
            ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=self.device)
            vals = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32, device=self.device)
            self._bias = (ids, vals)

    @property
    def greedy(self) -> bool:
        return self.params.temperature < GREEDY_BELOW

    @property
    def plain(self) -> bool:
        """True when steps 1-3 leave the logits as they are (no bias, no penalties)."""
        p = self.params
        return (
            self._bias is None
            and p.repetition_penalty == 1.0
            and not (p.frequency_penalty or p.presence_penalty)
        )

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
        """The next token after ``output``: argmax when greedy, else drawn for index ``len(output)`` from
        stream :attr:`Stream.SAMPLE`."""
        if self.greedy:
            return int((logits if self.plain else self.adjusted(logits, prompt, output)).argmax())
        return self.draw(self.distribution(logits, prompt, output), len(output), Stream.SAMPLE)

    def draw(self, probs: torch.Tensor, index: int, stream: Stream) -> int:
        """A token drawn from ``probs [V]`` (non-negative, not necessarily normalized) with the numbers of
        ``stream`` for output token ``index``: the same arguments always give the same token.
        ValueError where ``probs`` holds NaN or infinity or has no mass (:func:`drawn_token`).

        The generator is reseeded with the key for each draw; torch's CPU generator (mt19937) keeps the low
        32 bits of a seed, its CUDA one (Philox) all 64."""
        return drawn_token(int(self.draw_on_device(probs, index, stream)))

    def draw_on_device(self, probs: torch.Tensor, index: int, stream: Stream) -> torch.Tensor:
        """:meth:`draw`'s token as a ``[1]`` long tensor on the sampler's device, not read back to the host, or
        :data:`NO_TOKEN` where ``probs`` is no distribution (the reader raises, :func:`drawn_token`).

        The draw is ``torch.multinomial``'s for one sample, the same token from the same numbers (the index of
        the largest ``probs / Exp(1)``), without its device-side asserts: on a GPU a failed assert ends the
        process, where here the row that read the bad distribution fails alone."""
        self._generator.manual_seed(counter_key(self.seed, index, stream))
        probs = probs.to(self.device)
        race = torch.empty_like(probs).exponential_(generator=self._generator)
        torch.div(probs, race, out=race)
        token = race.argmax(-1, keepdim=True)
        won = race.gather(-1, token)
        return torch.where((won > 0) & (won < math.inf), token, NO_TOKEN)

    def uniform(self, index: int, stream: Stream) -> float:
        """A number in [0, 1) for output token ``index`` from ``stream``: the top 53 bits of its key, so
        every double of the form ``m / 2**53`` is equally likely."""
        return (counter_key(self.seed, index, stream) >> 11) * 2.0**-53

    def logprob(self, logits: torch.Tensor, token: int) -> TokenLogprob:
        lp = torch.log_softmax(logits.float(), dim=-1)
        entry = TokenLogprob(token=token, logprob=float(lp[token]))
        n = self.params.logprobs or 0
        if n:
            vals, ids = lp.topk(n)
            entry.top = [(int(i), float(v)) for i, v in zip(ids, vals)]
        return entry


def drawn_token(token: int) -> int:
    """A device draw read back: ``token``, or ValueError for :data:`NO_TOKEN`."""
    if token == NO_TOKEN:
        raise ValueError(
            "sampling: the next token's distribution holds NaN or infinite values or no mass "
            "(the model's logits are not finite)"
        )
    return token


def graph_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` of ``[V]`` or ``[R, V]`` (the first of equal maxima, NaN above all), for code captured
    in a CUDA graph: two short kernels on the kernels' devices (:mod:`ds4serve.kernels.argmax`; torch's takes
    ~27 us over a 129,280-wide row), torch elsewhere. Eager code calls torch's: a Triton launch from Python costs
    tens of microseconds of host time, which a graph's replay does not pay."""
    if not kernels.enabled(logits) or logits.stride(-1) != 1:
        return logits.argmax(-1)
    from ..kernels.argmax import argmax_rows

    return argmax_rows(logits.reshape(-1, logits.shape[-1])).view(logits.shape[:-1])


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
