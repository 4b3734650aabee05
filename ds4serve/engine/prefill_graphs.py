"""A prompt's first prefill chunk replayed as a CUDA graph, one graph per length bucket.

Only a chunk at position 0 is captured: there its forward reads nothing of the state, so it is a function
of its tokens and length alone and one capture per length serves every fresh prompt, over any state. A
prompt of ``n`` tokens runs in its bucket's graph (:func:`bucket_of`) padded after it; every layer is
causal, so only its first ``n`` rows count: the caller commits them, and the logits are row ``n - 1``'s,
chosen by a device index. Rows can differ from the unpadded forward's in the last bits, as chunkings do.

Capturable models (:func:`graphs_apply`): the embedding, the head, and routed experts whose grouped
products need no host synchronisation (dense bf16, or FP8 / MXFP4 read in place by
:mod:`ds4serve.kernels.grouped_experts`). A layer split in one process gets one graph per shard and bucket,
replayed in layer order with the streams copied into the next shard's input buffer between the replays.
Every bucket's graph shares one memory pool a device (they never run at the same time).
"""

from __future__ import annotations

import torch

from ..devices import on_device
from ..model import DeepSeekV4, ForwardResult
from ..model.linear import Weight
from ..model.moe_grouped import quant_grouped_applies
from ..parallel.split_model import SplitModel
from ..state import ChunkDelta, SequenceState
from .cuda_graphs import Captured

MAX_GRAPH_TOKENS = 2048  # longer chunks are bound by the GPU, not by the host's launches
MIN_BUCKET = 64
PAD_TOKEN = 0


def bucket_of(n: int, limit: int = MAX_GRAPH_TOKENS) -> int | None:
    """The smallest bucket (64 or 96 times a power of two, at most ``limit``) that holds ``n`` tokens;
    None when ``n`` is 0 or above ``limit``."""
    if not 0 < n <= limit:
        return None
    size = MIN_BUCKET
    while True:
        for b in (size, size * 3 // 2):
            if n <= b:
                return min(b, limit)
        size *= 2


def buckets(limit: int = MAX_GRAPH_TOKENS) -> list[int]:
    """Every bucket up to ``limit`` (the last one ``limit`` itself)."""
    out, n = [], 1
    while (b := bucket_of(n, limit)) is not None:
        out.append(b)
        n = b + 1
    return out


def shards_of(model: DeepSeekV4 | SplitModel) -> list[DeepSeekV4]:
    """The models that run a forward in turn: a split's shards in layer order, or the model itself."""
    return model.shards if isinstance(model, SplitModel) else [model]


def graphs_apply(model: DeepSeekV4 | SplitModel) -> bool:
    """Whether ``model``'s first chunks can be captured: every shard on a CUDA device, the embedding and the
    head, and every layer's routed experts dense bf16 or quantized experts that the grouped kernels take for
    activations like the embedding's (the shards share its dtype)."""
    shards = shards_of(model)
    if shards[0].embed is None or shards[-1].head is None:
        return False
    return all(shard_capturable(s) for s in shards)


def shard_capturable(shard: DeepSeekV4) -> bool:
    """Whether a first chunk of ``shard``'s layers can be captured: on a CUDA device, every layer's routed
    experts dense bf16 or taken by the grouped kernels (see :func:`graphs_apply`)."""
    if shard.device.type != "cuda":
        return False
    # a tensor like the chunk's activations: the embedding where the shard has it, else an empty one
    like = shard.embed if shard.embed is not None else torch.empty(0, dtype=shard.dtype, device=shard.device)
    return all(_routed_capturable(like, b.moe.w1, b.moe.w3, b.moe.w2) for b in shard.blocks.values())


def _routed_capturable(like: torch.Tensor, w1: Weight, w3: Weight, w2: Weight) -> bool:
    if all(isinstance(w, torch.Tensor) and w.dtype == torch.bfloat16 for w in (w1, w3, w2)):
        return True
    return quant_grouped_applies(like, w1, w3, w2)


def first_chunk_applies(state: SequenceState, n: int, limit: int) -> bool:
    """Whether a chunk of ``n`` tokens at ``state.pos`` runs as a first-chunk graph of at most ``limit``."""
    return state.pos == 0 and bucket_of(n, limit) is not None and n <= state.max_context


class ShardFirstChunk:
    """One shard's forward of ``width`` tokens at position 0 over a scratch state of its layers: from the
    tokens (the first shard) or the streams in ``hidden``, to the logits of one indexed row where the shard
    has the head. Captured (``graph``) or run uncaptured; a pipeline rank holds one per bucket
    (:mod:`ds4serve.parallel.pipeline`)."""

    def __init__(
        self, model: DeepSeekV4, width: int, pool: object | None, graph: bool, hidden: torch.Tensor | None
    ):
        self.model, self.width, self.hidden = model, width, hidden
        self.tokens = torch.full((width,), PAD_TOKEN, dtype=torch.long, device=model.device)
        self.row = torch.zeros(1, dtype=torch.long, device=model.device)
        self.scratch = model.new_state(width)  # never committed: the forward at 0 reads none of it
        self.step = Captured(self._forward, model.device, graph=graph, warmup=1, pool=pool)

    def _forward(self) -> ForwardResult:
        rows = self.row if self.model.head is not None else None
        return self.model.forward(self.tokens, self.scratch, hidden=self.hidden, logit_rows=rows)

    def run(self, ids: list[int]) -> ForwardResult:
        n = len(ids)
        padded = ids + [PAD_TOKEN] * (self.width - n)
        self.tokens.copy_(torch.tensor(padded, dtype=torch.long))
        self.row.fill_(n - 1)
        return self.step.replay()


class _BucketGraph:
    """A bucket's forward through every shard in layer order, the streams leaving one shard copied into the
    next one's input buffer between the replays."""

    def __init__(
        self, model: DeepSeekV4 | SplitModel, width: int, pools: dict[torch.device, object], graph: bool
    ):
        self.parts = []
        for k, shard in enumerate(shards_of(model)):
            hidden = (
                None
                if k == 0
                else torch.zeros(
                    width, shard.cfg.hc_mult, shard.cfg.hidden_size, dtype=shard.dtype, device=shard.device
                )
            )
            with on_device(shard.device):
                self.parts.append(ShardFirstChunk(shard, width, pools.get(shard.device), graph, hidden))

    def run(self, ids: list[int]) -> ForwardResult:
        layers = {}
        for k, part in enumerate(self.parts):
            with on_device(part.model.device):
                out = part.run(ids)
            layers.update(out.delta.layers)
            if k + 1 < len(self.parts):
                self.parts[k + 1].hidden.copy_(out.hidden)
        return ForwardResult(
            hidden=out.hidden, delta=ChunkDelta(start=0, tokens=list(ids), layers=layers), logits=out.logits
        )


class FirstChunkGraphs:
    """The captured first chunks of ``model`` (a whole model or a layer split) by bucket, captured on first
    use. ``graph=False`` runs the same padded forwards uncaptured (CPU tests)."""

    def __init__(self, model: DeepSeekV4 | SplitModel, limit: int = MAX_GRAPH_TOKENS, graph: bool = True):
        self.model, self.limit, self.graph = model, limit, graph
        self._pools = {s.device: torch.cuda.graph_pool_handle() for s in shards_of(model)} if graph else {}
        self._graphs: dict[int, _BucketGraph] = {}

    def capture_all(self) -> int:
        """Capture every bucket's graph not captured yet (a server's warm-up, so that no request pays a
        capture); returns how many were captured."""
        missing = [b for b in buckets(self.limit) if b not in self._graphs]
        for width in missing:
            self._graphs[width] = _BucketGraph(self.model, width, self._pools, self.graph)
        return len(missing)

    def applies(self, state: SequenceState, n: int) -> bool:
        """Whether a chunk of ``n`` tokens at ``state.pos`` runs through a graph."""
        return first_chunk_applies(state, n, self.limit)

    def forward(self, ids: list[int], state: SequenceState) -> ForwardResult:
        """The forward of ``ids`` at position 0 (:meth:`applies`), uncommitted: logits of its last row
        ``[1, V]``, the delta of its ``len(ids)`` tokens and their streams, in buffers the next call of the
        same bucket overwrites (commit them before)."""
        if not self.applies(state, len(ids)):
            raise ValueError(
                f"a first-chunk graph takes 1..{self.limit} tokens at position 0, "
                f"got {len(ids)} at {state.pos}"
            )
        width = bucket_of(len(ids), self.limit)
        g = self._graphs.get(width)
        if g is None:
            g = self._graphs[width] = _BucketGraph(self.model, width, self._pools, self.graph)
        out = g.run(ids)
        return ForwardResult(hidden=out.hidden[: len(ids)], delta=out.delta, logits=out.logits)
