"""A prompt's first prefill chunk replayed as a CUDA graph, one graph per length bucket.

A prefill chunk of up to ~2048 tokens is bound by the host: its forward launches ~140 kernels and ~17
compiled regions a layer, and the GPU waits for them (bench/RESULTS.md, fifteenth to seventeenth runs).
A graph replays all of them in one launch.

Only a chunk at position 0 is captured. There it reads nothing of the state: no ring rows are in the
window's reach, no compressor rows are buffered, no entries are committed. Its forward is a function of
its tokens and its length alone, so one capture per length serves every fresh prompt, over any state
(the deltas it returns are committed into the request's state afterwards, as an eager chunk's are).

Lengths are rounded up to a bucket (:func:`bucket_of`; 64 or 96 times a power of two). A prompt of ``n``
tokens runs in its bucket's graph with padding tokens after it, and only its first ``n`` rows count: every
layer is causal (attention, the compressors' windows, the indexer), so no real row sees a padded one,
:meth:`~ds4serve.state.SequenceState.commit` takes the first ``n`` rows, and the logits are those of row
``n - 1``, chosen by a device index. Padded rows are extra GPU work (at most half the bucket), not extra
launches. Row results can differ from the unpadded forward's in the last bits (the products' kernels
depend on their row count), as chunkings differ.

Graphs need routed experts whose grouped products run without a host synchronisation: dense bf16 tensors
(``torch._grouped_mm``), or with ``SWITCHES.quant_grouped_mm`` FP8 / MXFP4 experts that the grouped kernels
read in place (:mod:`ds4serve.kernels.grouped_experts`; without the switch quantized experts are dequantised
by groups whose sizes the host reads). The rest of a quantized model's chunk (the shared expert, the FP8
projections) dequantises whole weights on the device, which needs no host read either. Graphs also need a
whole model on one CUDA device. Every bucket's graph shares one memory pool: they never run at the same time.
"""

from __future__ import annotations

import torch

from ..model import DeepSeekV4, ForwardResult
from ..model.linear import Weight
from ..model.moe_grouped import quant_grouped_applies
from ..state import ChunkDelta, SequenceState
from .cuda_graphs import Captured

MAX_GRAPH_TOKENS = 2048  # longer chunks are bound by the GPU (bench/RESULTS.md, seventeenth run)
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


def graphs_apply(model: DeepSeekV4) -> bool:
    """Whether ``model``'s first chunks can be captured: one CUDA device, embedding and head, and every
    layer's routed experts dense bf16 or, with ``SWITCHES.quant_grouped_mm``, quantized experts that the
    grouped kernels take for activations like the embedding's."""
    if model.device.type != "cuda" or model.embed is None or model.head is None:
        return False
    return all(_routed_capturable(model.embed, b.moe.w1, b.moe.w3, b.moe.w2) for b in model.blocks.values())


def _routed_capturable(like: torch.Tensor, w1: Weight, w3: Weight, w2: Weight) -> bool:
    if all(isinstance(w, torch.Tensor) and w.dtype == torch.bfloat16 for w in (w1, w3, w2)):
        return True
    return quant_grouped_applies(like, w1, w3, w2)


class _BucketGraph:
    """The forward of ``width`` tokens at position 0 over a scratch state, logits of one indexed row."""

    def __init__(self, model: DeepSeekV4, width: int, pool: object | None, graph: bool):
        self.model, self.width = model, width
        self.tokens = torch.full((width,), PAD_TOKEN, dtype=torch.long, device=model.device)
        self.row = torch.zeros(1, dtype=torch.long, device=model.device)
        self.scratch = model.new_state(width)  # never committed: the forward at 0 reads none of it
        self.step = Captured(self._forward, model.device, graph=graph, warmup=1, pool=pool)

    def _forward(self) -> ForwardResult:
        return self.model.forward(self.tokens, self.scratch, logit_rows=self.row)

    def run(self, ids: list[int]) -> ForwardResult:
        n = len(ids)
        padded = ids + [PAD_TOKEN] * (self.width - n)
        self.tokens.copy_(torch.tensor(padded, dtype=torch.long))
        self.row.fill_(n - 1)
        return self.step.replay()


class FirstChunkGraphs:
    """The captured first chunks of ``model`` by bucket, captured on first use. ``graph=False`` runs the
    same padded forwards uncaptured (CPU tests)."""

    def __init__(self, model: DeepSeekV4, limit: int = MAX_GRAPH_TOKENS, graph: bool = True):
        self.model, self.limit, self.graph = model, limit, graph
        self._pool = torch.cuda.graph_pool_handle() if graph else None
        self._graphs: dict[int, _BucketGraph] = {}

    def capture_all(self) -> int:
        """Capture every bucket's graph not captured yet (a server's warm-up, so that no request pays a
        capture); returns how many were captured."""
        missing = [b for b in buckets(self.limit) if b not in self._graphs]
        for width in missing:
            self._graphs[width] = _BucketGraph(self.model, width, self._pool, self.graph)
        return len(missing)

    def applies(self, state: SequenceState, n: int) -> bool:
        """Whether a chunk of ``n`` tokens at ``state.pos`` runs through a graph."""
        return state.pos == 0 and bucket_of(n, self.limit) is not None and n <= state.max_context

    def forward(self, ids: list[int], state: SequenceState) -> ForwardResult:
        """The forward of ``ids`` at position 0 (:meth:`applies`), uncommitted: logits of its last row
        ``[1, V]``, the delta of its ``len(ids)`` tokens and their streams, in buffers the next call of the
        same bucket overwrites (commit them before)."""
        if not self.applies(state, len(ids)):
            raise ValueError(f"a first-chunk graph takes 1..{self.limit} tokens at position 0, "
                             f"got {len(ids)} at {state.pos}")
        width = bucket_of(len(ids), self.limit)
        g = self._graphs.get(width)
        if g is None:
            g = self._graphs[width] = _BucketGraph(self.model, width, self._pool, self.graph)
        out = g.run(ids)
        delta = ChunkDelta(start=0, tokens=list(ids), layers=out.delta.layers)
        return ForwardResult(hidden=out.hidden[:len(ids)], delta=delta, logits=out.logits)
