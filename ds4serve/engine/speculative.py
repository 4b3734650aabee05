"""Lossless speculative decoding: the proposer interface, exact verification, the decode loop.

One step drafts up to ``k`` tokens after the seed (the last emitted, not yet forwarded token),
runs **one** target forward over ``[seed, d1 .. dk]`` that writes nothing, then walks the rows:
row ``i`` gives the target's exact next-token distribution after ``seed, d1 .. di`` (penalties,
bias, temperature, top-k/p, min-p and the reasoning budget included, through
:class:`~ds4serve.engine.generation.Generation`). Draft ``d(i+1)`` is accepted with probability
``min(1, p/q)``; the first rejection draws from ``normalize(max(p - q, 0))`` and ends the step;
when every draft is accepted the bonus token is drawn from the last row. The state then commits
exactly the tokens whose rows were used, so the state after any step equals plain decoding's.

Greedy requests are the special case of one-hot ``p`` (accept iff the draft is the argmax), so
temperature 0 reproduces plain decoding token for token, whatever the draft proposes.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator

import torch

from ..model import ForwardResult
from ..state import SequenceState
from .generation import Generation
from .sampler import Sampler, Stream

if TYPE_CHECKING:
    from .engine import Engine, VerifyStep
    from .step_loop import RequestHandle

DEFAULT_THRESHOLDS = (0.40, 0.30)  # survival products that widen the verify to 3, then 4 tokens
DEFAULT_EWMA_ALPHA = 0.3


@dataclass
class Draft:
    """Proposed tokens and, when they were sampled, the exact distributions they were drawn from."""

    tokens: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] | None = None  # [V] per token; None = deterministic (one-hot) drafts
    confidence: list[float] | None = None  # P(draft i accepted | drafts before it accepted)
    on_device: torch.Tensor | None = None  # [k] long on the target's device, until resolve() reads it
    seeded: torch.Tensor | None = None  # [1 + k] the verify block with its seed, where the proposer wrote it

    @property
    def count(self) -> int:
        """How many tokens were drafted."""
        return len(self.tokens) if self.on_device is None else self.on_device.numel()

    def block(self, seed: int, n: int) -> list[int] | torch.Tensor:
        """The verify block ``[seed, d1..dn]``: on the device while the drafts are only there (before
        :meth:`resolve`), so that no host round trip comes between drafting and launching the verify."""
        if self.on_device is None or self.tokens:
            return [seed] + self.tokens[:n]
        if self.seeded is not None and n == self.count:
            return self.seeded
        block = torch.empty(n + 1, dtype=torch.long, device=self.on_device.device)
        block[:1].fill_(seed)  # the id goes as a kernel argument: no copy from the host
        block[1:].copy_(self.on_device[:n])
        return block

    def resolve(self, chosen: torch.Tensor | None = None) -> list[int] | None:
        """Read drafts kept on the device into ``tokens``, and the token ids ``chosen`` (a device tensor on the
        drafts' device, or None) with them, in one wait for the device: call it once the verify forward has been
        launched. Returns ``chosen``'s ids (None without)."""
        pending = self.on_device is not None and not self.tokens
        parts = ([self.on_device] if pending else []) + ([] if chosen is None else [chosen])
        ids = torch.cat(parts).tolist() if parts else []
        if pending:
            self.tokens, ids = ids[: self.count], ids[self.count :]
        return None if chosen is None else ids


@dataclass
class Committed:
    """What one verify step committed to the target state, as a draft model needs it. The streams are views of
    the verify forward's buffers, valid during :meth:`DraftProposer.observe` only: copy what is kept."""

    start: int  # position of the first committed token
    tokens: list[int]  # the committed tokens (the seed and the accepted drafts)
    next_token: int  # the token emitted after them: the next step's seed
    hidden: torch.Tensor  # [n, hc, D] target streams after the last layer (before hc_head)
    captured: dict[int, torch.Tensor]  # layer -> [n, hc, D] streams after that layer
    next_on_device: torch.Tensor | None = None  # [n] the token after each committed one, where the step chose
    # them on the target's device: ``tokens[1:] + [next_token]`` without a copy from the host


class DraftProposer:
    """Proposes draft tokens for the next verify step.

    The engine calls :meth:`begin` once per request with the committed context, :meth:`propose`
    before each verify step, :meth:`observe` after each step that generation continues from and
    :meth:`end` once the request ended.
    A proposer keeps any per-request state (draft caches) aligned with ``observe``: only committed
    tokens ever reach it. ``capture_layers`` names target layers whose output streams
    :meth:`observe` needs; they are captured inside the verify forward at no extra pass.
    """

    name = "draft"
    capture_layers: tuple[int, ...] = ()
    confidence_scheduled = False  # True when drafts carry a confidence that sets the verify width

    def __init__(
        self,
        max_draft_tokens: int = 4,
        *,
        adaptive: bool = True,
        thresholds: tuple[float, ...] = DEFAULT_THRESHOLDS,
        ewma_alpha: float = DEFAULT_EWMA_ALPHA,
    ):
        if max_draft_tokens < 0:
            raise ValueError(f"max_draft_tokens: expected an integer >= 0, got {max_draft_tokens}")
        self.max_draft_tokens = max_draft_tokens
        self.adaptive = adaptive
        self.thresholds = tuple(thresholds)
        self.ewma_alpha = ewma_alpha
        self.forwards = 0  # draft model passes, for the stats

    def begin(self, history: list[int], max_context: int) -> None:
        """A new request whose committed tokens are ``history``."""

    def propose(self, history: list[int], k: int, sampler: Sampler, index: int) -> Draft:
        """Up to ``k`` tokens to follow ``history`` (its last token is the seed, not yet committed);
        ``index`` is the output index of the first of them (draft ``j`` proposes output token ``index + j``).

        Sampled drafts must be drawn with :func:`pick` (stream ``DRAFT`` at their own index) and come with
        their distributions.
        """
        raise NotImplementedError

    def observe(self, committed: Committed) -> None:
        """The target committed ``committed.tokens``; the next seed is ``committed.next_token``."""

    def follow(self, committed: Committed, k: int, block: torch.Tensor) -> Draft | None:
        """:meth:`observe` then :meth:`propose` of ``k`` greedy drafts without waiting for the device, for a
        greedy request whose committed tokens were chosen there (``committed.next_on_device``): the seed and
        the drafts are written into ``block`` (``[k + 1]``, the next verify's own buffer) and the draft says
        so (``seeded``). None where this proposer cannot: the caller then observes and proposes."""
        return None

    def end(self) -> None:
        """The request ended (or never started decoding): give back what it held. A proposer serves one
        request at a time."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(max_draft_tokens={self.max_draft_tokens})"


class PromptFeed:
    """Hands the prefilled prompt to a proposer chunk by chunk, so its draft starts with context.

    :meth:`DraftProposer.observe` needs the token after each row, so a chunk is passed on once the
    next one arrives; the last chunk waits for the first sampled token (:meth:`flush`).
    """

    def __init__(self, proposer: DraftProposer):
        self.proposer = proposer
        self.capture_layers = tuple(proposer.capture_layers)
        self._tail: tuple[int, list[int], ForwardResult] | None = None

    def __call__(self, start: int, tokens: list[int], result: ForwardResult) -> None:
        self.flush(tokens[0])
        self._tail = (start, list(tokens), result)

    def flush(self, next_token: int) -> None:
        if self._tail is None:
            return
        start, tokens, result = self._tail
        self._tail = None
        self.proposer.observe(
            Committed(
                start=start,
                tokens=tokens,
                next_token=next_token,
                hidden=result.hidden,
                captured=dict(result.captured),
            )
        )


def pick(logits: torch.Tensor, sampler: Sampler, index: int) -> tuple[int, torch.Tensor | None]:
    """:func:`pick_on_device`'s draft read back to the host."""
    token, probs = pick_on_device(logits, sampler, index)
    return int(token), probs


def pick_on_device(
    logits: torch.Tensor, sampler: Sampler, index: int, argmax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A draft of output token ``index`` from draft logits ``[V]``, as a ``[1]`` long tensor on their device:
    argmax when greedy (``argmax``, when a captured pass took it), else sampled at the temperature from stream
    ``DRAFT``; and the distribution it was drawn from (None: greedy)."""
    if sampler.greedy:
        return (logits.argmax() if argmax is None else argmax).view(1), None
    probs = torch.softmax(logits.float() / sampler.params.temperature, dim=-1)
    # a draft from no distribution (NaN logits) is still a token of the vocabulary; its verification fails the row
    return sampler.draw_on_device(probs, index, Stream.DRAFT).clamp_min(0).to(logits.device), probs


def verify_token(
    p: torch.Tensor, draft: int, q: torch.Tensor | None, sampler: Sampler, index: int
) -> tuple[int, bool]:
    """Accept ``draft`` of output token ``index`` under target distribution ``p`` given draft distribution
    ``q`` (None: one-hot).

    Returns ``(token, accepted)``: the draft with probability ``min(1, p[d]/q[d])`` (stream ``ACCEPT``),
    otherwise a token drawn from ``normalize(max(p - q, 0))`` (stream ``RESIDUAL``). The token is then
    distributed exactly as ``p``.
    """
    pd = float(p[draft])
    qd = 1.0 if q is None else float(q[draft])
    if pd >= qd or (pd > 0 and sampler.uniform(index, Stream.ACCEPT) * qd < pd):
        return draft, True
    residual = p.clone() if q is None else (p - q.to(p.device)).clamp_min(0)
    residual[draft] = 0.0
    total = float(residual.sum())
    if total <= 0:  # p == q up to rounding: rejection had probability ~0; fall back to p without the draft
        residual = p.clone()
        residual[draft] = 0.0
        total = float(residual.sum())
    return sampler.draw(residual / total, index, Stream.RESIDUAL), False


def verify_row(
    gen: Generation, logits: torch.Tensor, draft: int, q: torch.Tensor | None, index: int
) -> tuple[int, bool]:
    """:func:`verify_token` of output token ``index`` under the exact distribution of verify row ``logits``.
    A greedy or forced target's distribution is one-hot, where the rule reduces to "the draft passes when it
    is the chosen token, else the chosen token is emitted", whatever ``q``: that is decided from the chosen
    token alone, without forming the distribution."""
    if gen.sampler.greedy or gen.forced() is not None:
        token = gen.choose(logits)
        return token, token == draft
    return verify_token(gen.distribution(logits), draft, q, gen.sampler, index)


class WidthPolicy:
    """How many drafts to request and to verify each step.

    Fixed (``adaptive=False``): always ``max_draft_tokens``. Adaptive with a confidence head: one
    draft, plus one more for each leading survival product ``c1*..*c(j+1)`` that reaches
    ``thresholds[j-1]`` (defaults: 2 drafts if c1*c2 >= 0.40, 3 if also c1*c2*c3 >= 0.30).
    Adaptive without one: ``round(EWMA of accepted drafts) + 1``.
    """

    def __init__(self, proposer: DraftProposer):
        self.max_draft = proposer.max_draft_tokens
        self.adaptive = proposer.adaptive
        self.by_confidence = proposer.adaptive and proposer.confidence_scheduled
        self.thresholds = proposer.thresholds
        self.alpha = proposer.ewma_alpha
        self.ewma = float(self.max_draft)

    def budget(self, limit: int) -> int:
        """Drafts to ask for, at most ``limit`` (tokens left in the request and the context)."""
        k = self.max_draft
        if self.adaptive and not self.by_confidence:
            k = min(k, int(self.ewma + 0.5) + 1)
        return max(0, min(k, limit))

    def verify_count(self, draft: Draft, k: int) -> int:
        """Drafts of ``draft`` to verify (at most ``k``)."""
        n = min(draft.count, k)
        if self.by_confidence and draft.confidence and n > 1:
            n = min(n, confident_prefix(draft.confidence, self.thresholds))
        return n

    def update(self, accepted: int) -> None:
        self.ewma = self.alpha * accepted + (1 - self.alpha) * self.ewma


def confident_prefix(confidence: list[float], thresholds: tuple[float, ...]) -> int:
    """1 + the number of leading thresholds met by the survival products of ``confidence``."""
    n, survival = 1, confidence[0]
    for j, threshold in enumerate(thresholds):
        if j + 1 >= len(confidence):
            break
        survival *= confidence[j + 1]
        if survival < threshold:
            break
        n = j + 2
    return n


@dataclass
class SpeculativeStats:
    """Per-request speculative counters; ``as_dict`` goes to ``GenerateResult.stats.speculative``."""

    method: str
    steps: int = 0  # verify forwards of the target
    drafted: int = 0  # drafts verified
    accepted: int = 0
    emitted: int = 0  # tokens produced by verify steps (accepted drafts + corrections + bonuses)
    draft_forwards: int = 0
    widths: Counter = field(default_factory=Counter)
    drafted_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)

    def record(self, drafted: int, accepted: int, emitted: int) -> None:
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        self.emitted += emitted
        self.widths[drafted + 1] += 1
        while len(self.drafted_at) < drafted:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
        for i in range(drafted):
            self.drafted_at[i] += 1
            self.accepted_at[i] += i < accepted

    def as_dict(self) -> dict:
        steps = max(self.steps, 1)
        return {
            "method": self.method,
            "steps": self.steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "emitted": self.emitted,
            "draft_forwards": self.draft_forwards,
            "mean_accepted": self.accepted / steps,
            "tokens_per_forward": self.emitted / steps,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
            "acceptance_by_position": [a / d for a, d in zip(self.accepted_at, self.drafted_at)],
            "verify_widths": dict(sorted(self.widths.items())),
        }


def speculative_decode(
    engine: "Engine",
    handle: "RequestHandle",
    state_of: Callable[[], SequenceState],
    logits: torch.Tensor,
    feed: PromptFeed,
    gen: Generation,
    emit: Callable[[int], None],
    solo: Callable[[], bool],
) -> Iterator[None]:
    """The speculative decode loop: the tokens plain decoding would produce, handed to ``emit`` one by one.

    The first ``next()`` chooses the first token from ``logits``; each later one runs one verify step, which
    emits one to ``k + 1`` tokens (a cancellation seen between two of them ends the step there), commits
    them to the request's state (``state_of()``, read at every step: a preempted request resumes in another
    one) and hands them to the proposer before it returns, so other sequences' verify steps may run between two
    steps. Where the proposer followed its drafts into the next block on the device and ``solo()`` says no
    other sequence verifies, the step also launches the next verify before it returns, so that the device runs
    it while the host emits; should another verify run before the next step reads it (its buffers share their
    memory), that step runs it again. ``feed`` carries the
    proposer, already begun and fed the prefilled prompt by the engine; ``gen`` decides and records the
    request's tokens. With a constraint (structured output, in ``gen``) every row's distribution is the
    masked one, the mask following the tokens accepted before that row, so a draft the rule forbids is
    rejected like any other the target would not emit, and the tokens are those of plain constrained
    decoding.
    """
    proposer = feed.proposer
    res, params = handle.result, handle.params
    stats = SpeculativeStats(proposer.name)
    policy = WidthPolicy(proposer)
    state = state_of()
    history = list(state.tokens)
    capture = feed.capture_layers
    draft_passes = proposer.forwards
    decode_start = time.perf_counter()
    followed: _Followed | None = None

    def budget() -> int:
        """Drafts to ask for: room for them and the token after, in the request and in the context."""
        return policy.budget(min(params.max_tokens - len(res.tokens), state.max_context - state.pos) - 1)

    try:
        if handle.cancelled:
            gen.cancel()
            return
        seed = gen.choose(logits)
        done = gen.accept(seed, logits)
        history.append(seed)
        emit(seed)
        yield
        if not done:
            feed.flush(seed)
        while not done:
            if handle.cancelled:
                gen.cancel()
                break
            state = state_of()  # another one after a preemption
            if followed is not None and followed.preemptions != res.stats.preemptions:
                followed = None  # its block is in a verify graph that another request may have used since
            if followed is None:
                k = budget()
                draft = (
                    _checked(
                        proposer.propose(history, k, gen.sampler, len(res.tokens)), engine.cfg.vocab_size
                    )
                    if k
                    else Draft()
                )
                n = policy.verify_count(draft, k)
                step = None
            else:
                draft, n = followed.draft, followed.draft.count
                step = followed.step if followed.current(engine) else None
                followed = None
            if step is None:
                step = engine.verify(state, draft.block(seed, n), capture)
            out = step.out  # buffers that the next verify step overwrites
            # each row's token on the device where its argmax decides it, read back with the drafts in one wait
            rows_argmax = _argmax_choices(gen, out, n + 1)
            chosen = draft.resolve(rows_argmax)
            block = draft.block(seed, n)
            tokens: list[int] = []
            accepted = 0
            for i in range(len(block)):
                if i and handle.cancelled:
                    break
                row = out.logits[i]
                ok = False
                if chosen is not None:
                    token = chosen[i]
                    ok = i < n and token == block[i + 1]
                elif i < n:
                    q = None if draft.probs is None else draft.probs[i]
                    token, ok = verify_row(gen, row, block[i + 1], q, len(res.tokens))
                else:
                    token = gen.choose(row)
                accepted += ok
                tokens.append(token)
                done = gen.accept(token, row)
                emit(token)
                if done or not ok:
                    break
            emitted = len(tokens)
            history += tokens
            start = state.pos
            step.commit(block[:emitted])
            state.last_logits = out.logits[emitted - 1].clone()
            seed = tokens[-1]
            stats.record(n, accepted, emitted)
            policy.update(accepted)
            if not done:
                committed = Committed(
                    start=start,
                    tokens=block[:emitted],
                    next_token=seed,
                    hidden=out.hidden[:emitted],
                    captured={layer: x[:emitted] for layer, x in out.captured.items()},
                    next_on_device=None if rows_argmax is None else rows_argmax[:emitted],
                )
                ready = None
                if rows_argmax is not None and not handle.cancelled:
                    ready = _follow(engine, state, proposer, committed, budget(), capture)
                if ready is None:
                    proposer.observe(committed)
                else:
                    followed = _Followed(ready, res.stats.preemptions)
                    if solo():
                        followed.launch(engine, state, seed, capture)
            yield
    finally:
        stats.draft_forwards = proposer.forwards - draft_passes
        res.stats.speculative = stats.as_dict()
        res.timings.decode_s = time.perf_counter() - decode_start


@dataclass
class _Followed:
    """The next step's drafts, already in its verify graph's block (:meth:`DraftProposer.follow`), the request's
    preemptions then, and that step's verify where it was launched before the step returned."""

    draft: Draft
    preemptions: int
    step: "VerifyStep | None" = None
    verifies: int = 0  # the engine's verify count just after ``step`` was launched

    def launch(self, engine: "Engine", state: SequenceState, seed: int, capture: tuple[int, ...]) -> None:
        self.step = engine.verify(state, self.draft.block(seed, self.draft.count), capture)
        self.verifies = engine.verifies

    def current(self, engine: "Engine") -> bool:
        """True when the step was launched and no verify ran after it: its buffers hold its result."""
        return self.step is not None and engine.verifies == self.verifies


def _follow(
    engine: "Engine",
    state: SequenceState,
    proposer: DraftProposer,
    committed: Committed,
    k: int,
    capture: tuple[int, ...],
) -> Draft | None:
    """The next step's ``k`` drafts written by the proposer straight into the block buffer of that step's
    verify graph (:meth:`DraftProposer.follow`); None where there is no such buffer or the proposer cannot."""
    block = engine.verify_block(state, k + 1, capture) if k else None
    return None if block is None else proposer.follow(committed, k, block)


def _argmax_choices(gen: Generation, out: ForwardResult, rows: int) -> torch.Tensor | None:
    """The verify rows' argmax on the device (the captured verify took it) where it decides each row's token."""
    if not gen.argmax_decides(rows):
        return None
    return out.logits.argmax(-1) if out.choices is None else out.choices


def _checked(draft: Draft, vocab_size: int) -> Draft:
    bad = [t for t in draft.tokens if not (isinstance(t, int) and 0 <= t < vocab_size)]
    if bad:
        raise ValueError(
            f"draft proposer returned token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}"
        )
    if draft.probs is not None and len(draft.probs) < draft.count:
        raise ValueError(f"draft proposer returned {len(draft.probs)} distributions for {draft.count} tokens")
    return draft


__all__ = [
    "Draft",
    "Committed",
    "DraftProposer",
    "PromptFeed",
    "WidthPolicy",
    "SpeculativeStats",
    "verify_token",
    "verify_row",
    "pick",
    "pick_on_device",
    "confident_prefix",
    "speculative_decode",
]
