"""Per-request bookkeeping shared by plain and speculative decoding.

:class:`Generation` decides the next token (sampled, or forced by the reasoning budget), records
each accepted token (reasoning/answer counts, logprobs, timing) and says when to stop. Both decode
loops go through it, so stop tokens, budgets and logprobs behave identically in both.
"""

from __future__ import annotations

import time

import torch

from ..config import ModelConfig
from ..tokenizer import Tokenizer
from .constraint import Constraint
from .request import ErrorCode, GenerateResult, SamplingParams
from .sampler import Sampler, Stream


class Generation:
    def __init__(
        self,
        prompt: list[int],
        params: SamplingParams,
        result: GenerateResult,
        cfg: ModelConfig,
        tokenizer: Tokenizer,
        device: torch.device,
        start: float,
        constraint: Constraint | None = None,
    ):
        """``constraint``: the matcher of the request's ``json_schema`` or ``grammar`` (the engine compiles it before
        prefill)."""
        self.prompt = prompt
        self.params = params
        self.result = result
        self.start = start
        self.sampler = Sampler(params, cfg.vocab_size, device)
        self.stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            self.stops.add(cfg.eos_token_id)
        self.think_end = tokenizer.think_end_id
        thinking = params.thinking
        self.reasoning = thinking if thinking is not None else prompt[-1] == tokenizer.think_start_id
        if params.logprobs is not None:
            result.logprobs = []
        self.constraint = constraint
        self.ended = False  # True once a token ended the generation, or it was cancelled

    @property
    def output(self) -> list[int]:
        return self.result.tokens

    def forced(self) -> int | None:
        """The token the reasoning budget forces next (``</think>``), if any."""
        budget = self.params.reasoning_budget
        if self.reasoning and budget is not None and self.result.stats.reasoning_tokens >= budget:
            return self.think_end
        return None

    def choose(self, logits: torch.Tensor) -> int:
        forced = self.forced()
        if forced is not None:
            return forced
        return self.sampler.sample(self._constrained(logits), self.prompt, self.output)

    def decides_ahead(self, rows: int) -> bool:
        """True when each of the next ``rows`` output tokens is chosen from its own logits alone, whatever the tokens
        accepted before it: no bias or penalties, no constraint, ``min_tokens`` reached and no forced ``</think>``
        within reach. A decode step's rows that decide ahead are decided on the device and read back in one wait
        (greedy ones also a verify block's, :meth:`argmax_decides`); the others one by one."""
        p = self.params
        budget = p.reasoning_budget
        reaches_budget = (
            self.reasoning and budget is not None and self.result.stats.reasoning_tokens + rows > budget
        )
        return (
            self.sampler.plain
            and self.constraint is None
            and len(self.output) >= p.min_tokens
            and not reaches_budget
        )

    def argmax_decides(self, rows: int) -> bool:
        """True when :meth:`choose` picks each of the next ``rows`` output tokens as the argmax of its logits
        (greedy, and :meth:`decides_ahead`): a verify block's rows are then decided together on the device."""
        return self.sampler.greedy and self.decides_ahead(rows)

    def draw_on_device(self, logits: torch.Tensor) -> torch.Tensor:
        """:meth:`choose`'s token as a ``[1]`` long tensor on the sampler's device, not read back, for a sampled
        request where :meth:`decides_ahead` holds (the same draw from the same distribution)."""
        return self.sampler.draw_on_device(self.distribution(logits), len(self.output), Stream.SAMPLE)

    def distribution(self, logits: torch.Tensor) -> torch.Tensor:
        """The exact distribution of the next token (one-hot when forced or greedy)."""
        forced = self.forced()
        if forced is not None:
            return (
                torch.nn.functional.one_hot(torch.tensor(forced), logits.shape[-1])
                .float()
                .to(self.sampler.device)
            )
        return self.sampler.distribution(self._constrained(logits), self.prompt, self.output)

    def _constrained(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` with what cannot continue the answer's schema or grammar masked (answer tokens of a request
        with one), and the stop tokens while fewer than ``min_tokens`` were generated, unless the schema or grammar
        allows nothing else (a complete answer ends: ``min_tokens`` cannot leave no token to choose). A request
        with a schema or grammar cannot end while it reasons: its stop tokens are masked until ``</think>``, so
        the answer the rule holds always comes (or the request runs out of tokens)."""
        early = len(self.output) < self.params.min_tokens
        if self.constraint is not None and not self.reasoning:
            return self.constraint.mask(logits, frozenset(self.stops) if early else frozenset())
        if not self.stops or not (early or self.constraint is not None):
            return logits
        ids = torch.tensor(sorted(self.stops), dtype=torch.long, device=logits.device)
        return logits.index_fill(-1, ids, float("-inf"))

    def accept(self, token: int, logits: torch.Tensor) -> bool:
        """Record ``token`` (sampled from ``logits``); True when generation must stop after it."""
        res = self.result
        if self.constraint is not None and not self.reasoning and token not in self.stops:
            self.constraint.consume(token)
        if self.reasoning:
            if token == self.think_end:
                res.stats.budget_forced_close = self.forced() is not None
                self.reasoning = False
            else:
                res.stats.reasoning_tokens += 1
        elif token not in self.stops:
            res.stats.answer_tokens += 1
        if res.logprobs is not None:
            res.logprobs.append(self.sampler.logprob(logits, token))
        res.tokens.append(token)
        if len(res.tokens) == 1:
            res.timings.first_token_s = time.perf_counter() - self.start
        if token in self.stops:
            res.finish_reason = "stop"
        elif len(res.tokens) >= self.params.max_tokens:
            res.finish_reason = "length"
        self.ended = token in self.stops or len(res.tokens) >= self.params.max_tokens
        return self.ended

    def cancel(self) -> None:
        self.ended = True
        res = self.result
        res.finish_reason, res.error = "cancelled", ErrorCode.CANCELLED
        res.error_message = f"cancelled after {len(res.tokens)} tokens"
