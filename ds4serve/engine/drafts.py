"""The built-in draft proposers (n-gram lookup, a client's predicted output, MTP, DSpark) and the draft
weights an engine holds.

``Engine.generate(speculative=...)`` accepts a :class:`~ds4serve.engine.speculative.DraftProposer`
or a string ``NAME`` / ``NAME:K`` with ``NAME`` in ``ngram``, ``mtp``, ``dspark`` and ``K`` the
most drafts per step. Model drafts load once from the engine's checkpoint into
:class:`DraftModels` (``engine.draft``), which ``park("draft")`` frees.

The draft caches start where speculative decoding starts: the prompt was prefilled before the
proposer existed, so the MTP and DSpark windows hold generated positions only (RoPE depends on
relative positions, so they count positions from 0). The first step therefore has no MTP draft.
"""

from __future__ import annotations

import bisect
import functools
import random
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from .. import profiler
from ..config import SLIDING, ModelConfig
from ..devices import ids_on, on_device
from ..model import DeepSeekV4
from ..model.deepseek4 import HeadWeights
from ..model.dspark import (
    DSparkWeights,
    base_logits,
    block_merged,
    confidence,
    context_rows,
    load_dspark,
    markov_bias,
    target_features,
)
from ..model.linear import GEMV_MAX_ROWS
from ..model.mtp import MTPWeights, load_mtp, mtp_forward, mtp_logits, mtp_names
from ..state import ChunkDelta, LayerDelta, SequenceState
from ..weights import Checkpoint, block_shapes
from .draft_graphs import DSparkGraphs, MTPGraphs, draft_state
from .dspark_weights import dspark_shapes
from .request import ErrorCode, GenerateError
from .sampler import Sampler
from .speculative import Committed, Draft, DraftProposer, pick, pick_on_device

if TYPE_CHECKING:
    from .engine import Engine

METHODS = ("mtp", "dspark", "ngram")
MAX_DRAFT_TOKENS = 16
# rows a draft pass runs as a graph (one per row count): what a verify step commits; prompt chunks,
# of any length, run eagerly
MAX_STATIC_ROWS = MAX_DRAFT_TOKENS + 1
_SPEC_RE = re.compile(r"^(?P<name>[a-z]+)(?::(?P<k>\d+))?$")


# ---- n-gram lookup ----------------------------------------------------------------------------
class NgramProposer(DraftProposer):
    """Prompt lookup: the continuation of the latest earlier occurrence of the longest suffix match.

    Suffixes of ``max_ngram`` down to ``min_ngram`` tokens are looked up in an index of every
    earlier n-gram of prompt + output (built incrementally); no weights needed.
    """

    name = "ngram"

    def __init__(self, max_draft_tokens: int = 4, *, max_ngram: int = 3, min_ngram: int = 1, **policy):
        super().__init__(max_draft_tokens, **policy)
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(
                f"ngram sizes: expected 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}"
            )
        self.sizes = range(max_ngram, min_ngram - 1, -1)
        self._index: dict[tuple[int, ...], int] = {}
        self._indexed = 0

    def begin(self, history: list[int], max_context: int) -> None:
        self._index = {}
        self._indexed = 0

    def propose(self, history: list[int], k: int, sampler: Sampler, index: int) -> Draft:
        last = len(history) - 1  # n-grams ending before the last token are candidates
        for end in range(self._indexed, last):
            for n in self.sizes:
                if end + 1 >= n:
                    self._index[tuple(history[end + 1 - n : end + 1])] = end
        self._indexed = max(self._indexed, last)
        for n in self.sizes:
            if len(history) > n:
                end = self._index.get(tuple(history[-n:]))
                if end is not None:
                    return Draft(history[end + 1 : end + 1 + k])
        return Draft()


class PredictionProposer(DraftProposer):
    """OpenAI's predicted outputs: drafts read from the answer the client expects (``prediction``, token ids).

    The output is aligned to the prediction as it grows: where the output so far ends with a run of tokens
    that the prediction holds at or after the point the last match ended (the longest run, up to
    ``max_ngram`` tokens), the draft is what follows that run in the prediction. Runs shorter than
    ``near_ngram`` tokens match only within ``window`` tokens of that point, so a common token far ahead
    does not pull the alignment away. Verification keeps the answer the target's own: a wrong prediction
    costs rejected drafts, never different tokens.

    At most 7 drafts a step: a verify block of up to ``GEMV_MAX_ROWS`` (8) rows runs the decode kernels, a wider
    one partly the prefill paths, which cost more per row (docs/SPECULATIVE.md).
    """

    name = "prediction"

    def __init__(
        self,
        prediction: list[int],
        max_draft_tokens: int = GEMV_MAX_ROWS - 1,
        *,
        max_ngram: int = 8,
        near_ngram: int = 3,
        window: int = 64,
        **policy,
    ):
        super().__init__(max_draft_tokens, **policy)
        self.prediction = list(prediction)
        self.max_ngram, self.near_ngram, self.window = max_ngram, near_ngram, window
        self._at: dict[tuple[int, ...], list[int]] = {}  # n-gram -> the positions it starts at, ascending
        for n in range(1, max_ngram + 1):
            for i in range(len(self.prediction) - n + 1):
                self._at.setdefault(tuple(self.prediction[i : i + n]), []).append(i)
        self._start: int | None = None
        self._cursor = 0  # where in the prediction the output is expected to go on

    def begin(self, history: list[int], max_context: int) -> None:
        self._start, self._cursor = None, 0

    def propose(self, history: list[int], k: int, sampler: Sampler, index: int) -> Draft:
        if self._start is None:  # the first call: the history is the prompt and the first output token
            self._start = len(history) - 1
        out = history[self._start :]
        for n in range(min(self.max_ngram, len(out)), 0, -1):
            starts = self._at.get(tuple(out[-n:]), [])
            i = bisect.bisect_left(starts, max(0, self._cursor - n))
            if i < len(starts) and (n >= self.near_ngram or starts[i] - self._cursor <= self.window):
                self._cursor = starts[i] + n
                return Draft(self.prediction[self._cursor : self._cursor + k])
        return Draft()


# ---- model drafts -----------------------------------------------------------------------------
@dataclass
class TargetParts:
    """What a model draft shares with the target: the embedding, the head, and the RoPE tables and
    device of the part that holds the head (the last shard of a layer split)."""

    cfg: ModelConfig
    embed: torch.Tensor
    head: HeadWeights  # the target's (its rows and their token ids)
    last: DeepSeekV4

    @property
    def device(self) -> torch.device:
        return self.last.device

    def embed_rows(self, ids: list[int] | torch.Tensor) -> torch.Tensor:
        """The embedding rows of ``ids`` on the drafts' device (the table is on the first shard's)."""
        rows = ids.to(self.embed.device) if isinstance(ids, torch.Tensor) else ids_on(ids, self.embed.device)
        return self.embed[rows].to(self.device)


def target_parts(model: object) -> TargetParts:
    shards = getattr(model, "shards", None) or [model]
    first, last = shards[0], shards[-1]
    if not (
        isinstance(first, DeepSeekV4)
        and isinstance(last, DeepSeekV4)
        and first.embed is not None
        and last.head is not None
    ):
        raise GenerateError(
            ErrorCode.INVALID_REQUEST,
            "speculative: model drafts need the target's embedding and "
            "head in this process (a multi-host pipeline does not have them); use 'ngram'",
        )
    return TargetParts(first.cfg, first.embed, last.head, last)


def _at_target(method: Callable) -> Callable:
    """Run a model draft's method with the device of the target's head current: Triton launches and CUDA
    graph replays go to the current device, which on a layer split is another shard's."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with on_device(self.target.device):
            return method(self, *args, **kwargs)

    return run


def _draft_layers(cfg: ModelConfig, stages: int) -> range:
    """Profiler layer ids of draft stages: numbered after the target's layers, as in the checkpoint."""
    return range(cfg.num_layers, cfg.num_layers + stages)


class _HeldPasses:
    """A model draft's proposer: the static passes it holds for its request (None: eager passes)."""

    passes: MTPGraphs | DSparkGraphs | None = None

    def end(self) -> None:
        if self.passes is not None:
            self.passes.release()


class MTPProposer(_HeldPasses, DraftProposer):
    """The checkpoint's MTP block chained ``k`` times; its window holds committed positions only.

    After each verify the block runs over the committed rows (target streams ``H_i`` with the
    next token), commits them to its window and keeps the last row's streams and logits: they
    give the first draft of the next step. Further drafts chain the block's own output streams
    through a scratch copy of the window that is then dropped.
    """

    name = "mtp"

    def __init__(
        self,
        weights: MTPWeights,
        target: TargetParts,
        max_draft_tokens: int = 3,
        *,
        passes: MTPGraphs | None = None,
        **policy,
    ):
        super().__init__(max_draft_tokens, **policy)
        self.w = weights
        self.target = target
        self.cfg = target.cfg
        self.state: SequenceState | None = None
        # streams [1, hc, D], logits [V] and their argmax [1] (None: not taken) of the last committed row
        self._last: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None
        self.passes = passes  # the static passes and their state (None: eager passes over a state of its own)

    def begin(self, history: list[int], max_context: int) -> None:
        need, t = max_context + MAX_DRAFT_TOKENS + 1, self.target.last
        self.state = (
            draft_state(self.cfg, 1, need, t.dtype, t.device)
            if self.passes is None
            else self.passes.reuse(need)
        )
        self._last = None

    def _run(self, state: SequenceState, hidden: torch.Tensor, next_ids: list[int]) -> torch.Tensor:
        """Forward rows at ``state.pos`` and commit them to ``state``; return the output streams."""
        t = self.target
        ids = torch.tensor(next_ids, dtype=torch.long, device=t.device)
        with profiler.step("draft", len(next_ids), state.pos, _draft_layers(self.cfg, 1)):
            G, delta = mtp_forward(
                self.w,
                hidden,
                ids,
                t.embed_rows(next_ids),
                t.last.chunk_info(state.pos, len(next_ids)),
                state.layers[0],
                self.cfg,
                t.last.ropes,
            )
        state.commit(ChunkDelta(start=state.pos, tokens=list(next_ids), layers={0: delta}), len(next_ids))
        self.forwards += 1
        return G

    @_at_target
    def observe(self, committed: Committed) -> None:
        next_ids = committed.tokens[1:] + [committed.next_token]
        if self.passes is not None and len(next_ids) <= MAX_STATIC_ROWS:
            with profiler.step(
                "draft", len(next_ids), self.state.pos, _draft_layers(self.cfg, 1), graph=True
            ):
                self._last = self.passes.observe(committed.hidden, next_ids, committed.next_on_device)
            self.forwards += 1
            return
        G = self._run(self.state, committed.hidden, next_ids)[-1:]
        self._last = (G, mtp_logits(self.w, G, self.target.head, self.cfg)[0], None)

    @_at_target
    def follow(self, committed: Committed, k: int, block: torch.Tensor) -> Draft | None:
        next_ids = committed.tokens[1:] + [committed.next_token]
        if (
            self.passes is None
            or committed.next_on_device is None
            or len(next_ids) > MAX_STATIC_ROWS
            or not block.device == self.target.embed.device == self.passes.device
        ):
            return None
        with profiler.step("draft", len(next_ids), self.state.pos, _draft_layers(self.cfg, 1), graph=True):
            self.passes.follow(committed.hidden, committed.next_on_device, next_ids, block)
        self.forwards += k  # the rows' pass and k - 1 chained ones
        self._last = None  # the drafts went into the block
        return Draft(on_device=block[1:], seeded=block)

    @_at_target
    def propose(self, history: list[int], k: int, sampler: Sampler, index: int) -> Draft:
        if self._last is None or k < 1:
            return Draft()
        G, logits, argmax = self._last
        token, q = pick_on_device(logits, sampler, index, argmax)
        # each draft is copied out at once: a greedy one is a view of its pass's buffer, which the next
        # chained pass overwrites
        drafts = torch.empty(k, dtype=torch.long, device=token.device)
        drafts[:1].copy_(token)
        probs = [q]
        if self.passes is not None and k > 1:
            self.passes.start_chain()
        scratch = self.state.fork() if k > 1 and self.passes is None else None
        for j in range(1, k):
            if self.passes is not None:
                with profiler.step(
                    "draft", 1, self.passes.scratch.pos, _draft_layers(self.cfg, 1), graph=True
                ):
                    G, logits, argmax = self.passes.step(G, token)
                self.forwards += 1
            else:
                G = self._run(scratch, G, token.tolist())
                logits, argmax = mtp_logits(self.w, G, self.target.head, self.cfg)[0], None
            token, q = pick_on_device(logits, sampler, index + j, argmax)
            drafts[j : j + 1].copy_(token)
            probs.append(q)
        return Draft(probs=None if sampler.greedy else probs, on_device=drafts)


class DSparkProposer(_HeldPasses, DraftProposer):
    """DSpark: one pass of the three stages drafts a block; the confidence head sets the width.

    Each stage's context ring receives the rows of committed positions only, from the target
    features captured inside the verify forward.
    """

    name = "dspark"
    confidence_scheduled = True

    def __init__(
        self,
        weights: DSparkWeights,
        target: TargetParts,
        max_draft_tokens: int | None = None,
        *,
        passes: DSparkGraphs | None = None,
        **policy,
    ):
        super().__init__(weights.spec.block_size if max_draft_tokens is None else max_draft_tokens, **policy)
        self.w = weights
        self.target = target
        self.cfg = target.cfg
        self.capture_layers = tuple(weights.spec.target_layer_ids)
        self.state: SequenceState | None = None
        self.passes = passes  # the static passes and their state (None: eager passes over a state of its own)

    def begin(self, history: list[int], max_context: int) -> None:
        need, t = max_context + 1, self.target.last
        self.state = (
            draft_state(self.cfg, len(self.w.stages), need, t.dtype, t.device)
            if self.passes is None
            else self.passes.reuse(need)
        )

    @_at_target
    def observe(self, committed: Committed) -> None:
        n, pos = len(committed.tokens), self.state.pos
        if self.passes is not None and n <= MAX_STATIC_ROWS:
            rows = self.passes.context(committed.captured)
        else:
            cos, sin = self.target.last.chunk_info(pos, n).rope["main"]
            rows = context_rows(
                self.w, target_features(committed.captured, self.capture_layers), cos, sin, self.cfg
            )
        delta = ChunkDelta(
            start=pos, tokens=committed.tokens, layers={s: LayerDelta(r) for s, r in enumerate(rows)}
        )
        self.state.commit(delta, n)

    @_at_target
    def propose(self, history: list[int], k: int, sampler: Sampler, index: int) -> Draft:
        t, spec, pos = self.target, self.w.spec, self.state.pos
        seed = history[-1]
        layers = _draft_layers(self.cfg, len(self.w.stages))
        if self.passes is not None:
            with profiler.step("draft", spec.block_size, pos, layers, graph=True):
                merged, logits = self.passes.propose(seed)
        else:
            ids = torch.tensor(
                [seed] + [spec.noise_token_id] * (spec.block_size - 1), dtype=torch.long, device=t.device
            )
            cos, sin = t.last.chunk_info(pos, spec.block_size).rope["main"]
            slots = torch.arange(max(0, pos - self.state.window), pos, device=t.device) % self.state.window
            context = [self.state.layers[s].window[slots] for s in range(len(self.w.stages))]
            with profiler.step("draft", spec.block_size, pos, layers):
                merged = block_merged(self.w, ids, t.embed_rows(ids), context, cos, sin, self.cfg)
                logits = base_logits(self.w, merged, t.head, self.cfg)
        self.forwards += 1
        tokens, probs, conf = [], [], []
        prev = seed
        for j in range(min(k, spec.block_size)):
            conf.append(confidence(self.w, merged[j], prev))
            prev, q = pick(logits[j] + markov_bias(self.w, prev), sampler, index + j)
            tokens.append(prev)
            probs.append(q)
        return Draft(tokens, None if sampler.greedy else probs, conf)


class OracleProposer(DraftProposer):
    """Drafts a known continuation: ``sequence`` is every token the generation will hold (prompt and
    output, e.g. of a plain greedy run), and each draft is right with probability ``p`` (else the next
    id). For tests and benchmarks of the verify path at a chosen acceptance; ``width`` = 1 + drafts."""

    name = "oracle"

    def __init__(self, sequence: list[int], p: float, width: int, seed: int = 0, vocab_size: int = 129280):
        super().__init__(width - 1, adaptive=False)
        self.sequence, self.p, self.vocab_size = sequence, p, vocab_size
        self.rng = random.Random(seed)

    def propose(self, history: list[int], k: int, sampler: Sampler, index: int) -> Draft:
        truth = self.sequence[len(history) : len(history) + k]
        return Draft([t if self.rng.random() < self.p else (t + 1) % self.vocab_size for t in truth])


# ---- loading and selection --------------------------------------------------------------------
def mtp_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Logical shapes of the first MTP block's tensors."""
    D, hc = cfg.hidden_size, cfg.hc_mult
    own = dict(zip(mtp_names(0), [(D, D), (D, D), (D,), (D,), (D,), (hc, hc * D), (hc,), (1,)]))
    return {**own, **{f"mtp.0.{n}": s for n, s in block_shapes(cfg, 0, SLIDING, hash_moe=False).items()}}


def tensor_problems(ckpt: Checkpoint, shapes: dict[str, tuple[int, ...]]) -> list[str]:
    problems = []
    for name, shape in shapes.items():
        if not ckpt.has(name):
            problems.append(f"missing tensor {name} (expected shape {list(shape)})")
        elif (actual := ckpt._logical_shape(name)) != shape:
            problems.append(f"tensor {name}: expected shape {list(shape)}, got {list(actual)}")
    return problems


def check_config(cfg: ModelConfig, where: object, kind: str) -> None:
    """Raise :class:`GenerateError` (invalid_request) when the config has no draft of ``kind``."""
    if kind == "mtp":
        if cfg.dspark is not None:
            raise GenerateError(
                ErrorCode.INVALID_REQUEST,
                "speculative: 'mtp' needs an MTP next-n block, but this "
                "checkpoint's mtp.* tensors are DSpark stages; use 'dspark'",
            )
        if cfg.n_mtp_layers < 1:
            raise GenerateError(
                ErrorCode.INVALID_REQUEST,
                f"speculative: 'mtp' needs an MTP block, but {where} has num_nextn_predict_layers = 0",
            )
    elif cfg.dspark is None:
        raise GenerateError(
            ErrorCode.INVALID_REQUEST,
            f"speculative: 'dspark' needs DSpark draft stages, but {where} has no dspark_block_size",
        )


def check_draft(ckpt: Checkpoint, kind: str) -> None:
    """Raise :class:`GenerateError` (invalid_request) when ``ckpt`` cannot serve draft ``kind``."""
    check_config(ckpt.cfg, ckpt.path / "config.json", kind)
    problems = tensor_problems(ckpt, mtp_shapes(ckpt.cfg) if kind == "mtp" else dspark_shapes(ckpt.cfg))
    if problems:
        raise GenerateError(
            ErrorCode.INVALID_REQUEST,
            f"speculative: the {kind} draft of {ckpt.path} is unusable "
            f"({len(problems)} problem(s)): " + "; ".join(problems[:10]),
        )


class DraftModels:
    """Draft weights of an engine's checkpoint by kind, loaded on first use, and their static passes (graphs
    and draft state, kept across requests); parkable as 'draft'."""

    def __init__(self, loaders: dict[str, Callable[[], object]]):
        self._loaders = loaders
        self._loaded: dict[str, object] = {}
        self._parked: set[str] = set()
        self._passes: dict[str, list[MTPGraphs | DSparkGraphs]] = {}

    def passes(self, kind: str, target: TargetParts, max_context: int) -> MTPGraphs | DSparkGraphs:
        """A set of static passes of draft ``kind`` for ``target`` (CUDA graphs on its head's device) that no
        running request holds, now held until its ``release()``: one made before if one is free, else a new
        one. The sets are kept until a park of the draft or the target forgets them."""
        sets = self._passes.setdefault(kind, [])
        passes = next((p for p in sets if not p.in_use), None)
        if passes is None:
            make = MTPGraphs if kind == "mtp" else DSparkGraphs
            passes = make(self.get(kind), target, max_context)
            sets.append(passes)
        passes.in_use = True
        return passes

    def forget_passes(self) -> None:
        """Drop the static passes (their graphs hold the target's and drafts' tensors)."""
        self._passes.clear()

    def get(self, kind: str) -> object:
        if kind in self._parked:
            raise GenerateError(ErrorCode.MODEL_PARKED, "the draft model is parked; unpark 'draft' first")
        if kind not in self._loaded:
            self._loaded[kind] = self._loaders[kind]()
        return self._loaded[kind]

    @property
    def loaded(self) -> list[str]:
        return sorted(self._loaded)

    def park(self) -> bool:
        if not self._loaded:
            return False
        self._parked.update(self._loaded)
        self._loaded.clear()
        self.forget_passes()
        return True

    def unpark(self) -> bool:
        if not self._parked:
            return False
        for kind in sorted(self._parked):
            self._loaded[kind] = self._loaders[kind]()
        self._parked.clear()
        return True


def _engine_drafts(engine: "Engine") -> DraftModels:
    if engine.draft is None:
        if engine.path is None:
            raise GenerateError(
                ErrorCode.INVALID_REQUEST,
                "speculative: this engine has no checkpoint path to load a draft model from",
            )
        path, dtype, device = engine.path, engine.dtype, engine.device

        def loader(kind: str) -> Callable[[], object]:
            def load() -> object:
                ckpt = Checkpoint(path)
                check_draft(ckpt, kind)
                return load_mtp(ckpt, 0, dtype, device) if kind == "mtp" else load_dspark(ckpt, dtype, device)

            return load

        engine.draft = DraftModels({kind: loader(kind) for kind in ("mtp", "dspark")})
    return engine.draft


def parse_speculative(speculative: object) -> tuple[str, int | None]:
    """``(NAME, K)`` of ``'mtp' | 'dspark' | 'ngram'[:K]`` (K None: the method's default); GenerateError naming
    ``speculative`` otherwise."""
    m = _SPEC_RE.match(speculative) if isinstance(speculative, str) else None
    if m is None or m["name"] not in METHODS:
        raise GenerateError(
            ErrorCode.INVALID_REQUEST,
            f"speculative: expected one of {list(METHODS)} (optionally "
            f"'NAME:K' for at most K drafts per step), got {speculative!r}",
        )
    k = None if m["k"] is None else int(m["k"])
    if k is not None and not 1 <= k <= MAX_DRAFT_TOKENS:
        raise GenerateError(
            ErrorCode.INVALID_REQUEST, f"speculative: K in '{speculative}' must be in [1, {MAX_DRAFT_TOKENS}]"
        )
    return m["name"], k


def resolve_proposer(engine: "Engine", speculative: object) -> DraftProposer:
    """The proposer for ``speculative``: a DraftProposer as is, or ``'mtp' | 'dspark' | 'ngram'[:K]``."""
    if isinstance(speculative, DraftProposer):
        return speculative
    name, k = parse_speculative(speculative)
    if name == "ngram":
        return NgramProposer() if k is None else NgramProposer(k)
    check_config(
        engine.cfg,
        "the checkpoint's config.json" if engine.path is None else engine.path / "config.json",
        name,
    )
    target = target_parts(engine.require_model())
    drafts = _engine_drafts(engine)
    weights = drafts.get(name)
    # the drafts' passes run on the device of the target's head: graphs there, for a whole model or a split
    static = not engine.eager and target.device.type == "cuda"
    passes = drafts.passes(name, target, engine.max_context + MAX_DRAFT_TOKENS + 1) if static else None
    if name == "mtp":
        return MTPProposer(weights, target, *(() if k is None else (k,)), passes=passes)
    return DSparkProposer(weights, target, k, passes=passes)
