"""Layer ranges on separate processes: a torch.distributed pipeline (NCCL on GPUs, gloo on CPUs).

Rank 0 owns the first layers, the embedding and the engine; rank ``r`` owns the ``r``-th layer
range; the last rank owns the head. Rank 0 drives everything through :class:`PipelineModel`,
which the engine uses like a :class:`~ds4serve.model.DeepSeekV4`:

* every state operation (allocate, forward, commit, reset, restore, snapshot, fork) is broadcast
  to all ranks on a gloo *control* group, so each rank applies it to its own layers' state;
* the hidden streams ``[S, hc, D]`` travel rank to rank on the default group; the last rank
  sends the final streams and the asked-for logits back to rank 0;
* each rank keeps the deltas of its forwards until rank 0 commits one (verify-then-commit works
  across ranks unchanged).

A rank that dies or stops answering turns into :class:`PipelineError` on the ranks that talk to
it: at once when its process is gone (its sockets close), at the latest after the data timeout
otherwise. After an error the pipeline is marked broken and every later call fails fast.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from .. import profiler
from ..config import ModelConfig
from ..engine.cuda_graphs import DecodeGraph, VerifyGraph
from ..engine.prefill_graphs import (
    PAD_TOKEN,
    ShardFirstChunk,
    bucket_of,
    buckets,
    first_chunk_applies,
    shard_capturable,
)
from ..model import DeepSeekV4
from ..model.batch import BatchForward, micro_batches
from ..model.deepseek4 import ForwardResult
from ..state import ChunkDelta, SequenceState, Snapshot

log = logging.getLogger("ds4serve.parallel")

IDLE_TIMEOUT = datetime.timedelta(days=7)  # workers wait this long for rank 0's next request


class PipelineError(RuntimeError):
    """A rank of the pipeline failed, died or stopped answering."""


@dataclass
class PipelineDelta(ChunkDelta):
    """Rank 0's part of a pipeline forward's delta; ``seq`` names the other ranks' parts."""

    seq: int = -1


@dataclass
class Groups:
    """The communicators of one process: data (hidden streams) and two gloo groups."""

    rank: int
    world: int
    control: Any  # rank 0's operations, broadcast; waits as long as a worker may stay idle
    objects: Any  # snapshots and the start-up handshake; bounded by the data timeout

    @classmethod
    def create(cls, timeout: datetime.timedelta) -> "Groups":
        """Groups on an initialised default process group (collective: every rank calls this)."""
        return cls(
            rank=dist.get_rank(),
            world=dist.get_world_size(),
            control=dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT),
            objects=dist.new_group(backend="gloo", timeout=timeout),
        )


@contextmanager
def _comm(what: str, peer: int | str) -> Iterator[None]:  # peer: a rank, or a range such as "1-3"
    """Turn a communication failure into a PipelineError naming the peer."""
    try:
        yield
    except PipelineError:
        raise
    except RuntimeError as exc:  # gloo and NCCL report lost peers and timeouts as RuntimeError subclasses
        raise PipelineError(
            f"pipeline: {what} with rank {peer} failed (the rank died, hung or exited): {exc}"
        ) from exc


def shard_handshake(shard: DeepSeekV4, groups: Groups) -> list[tuple[int, int, int]]:
    """Every rank's (layer start, layer stop, weight bytes), checked to tile the model in rank order."""
    mine = (shard.layers.start, shard.layers.stop, shard.nbytes())
    table: list[Any] = [None] * groups.world
    with _comm("the start-up handshake", "any"):
        dist.all_gather_object(table, mine, group=groups.objects)
    stop = 0
    for rank, (a, b, _) in enumerate(table):
        if a != stop:
            raise PipelineError(
                f"layer_split: rank {rank} holds layers {a}..{b - 1}, expected to start at {stop}"
            )
        stop = b
    if stop != shard.cfg.num_layers:
        raise PipelineError(f"layer_split: the ranks cover layers 0..{stop - 1} of {shard.cfg.num_layers}")
    return table


class _Link:
    """Hidden streams, logits and captured streams between this rank and its neighbours."""

    def __init__(self, shard: DeepSeekV4, groups: Groups):
        self.shard = shard
        self.groups = groups
        self.cfg: ModelConfig = shard.cfg

    def streams(self, tokens: int) -> torch.Tensor:
        return torch.empty(
            tokens, self.cfg.hc_mult, self.cfg.hidden_size, dtype=self.shard.dtype, device=self.shard.device
        )

    def send(self, t: torch.Tensor, dst: int, what: str) -> None:
        with _comm(f"sending {what}", dst):
            dist.send(t.contiguous(), dst=dst)

    def isend(self, t: torch.Tensor, dst: int, what: str) -> Callable[[], None]:
        """Start sending ``t`` to ``dst`` without waiting for the receiver; the returned call waits until it
        is sent. A micro-batched step sends this way: a rank that waited for its send while its receiver
        waited for a send of its own would deadlock."""
        t = t.contiguous()
        with _comm(f"sending {what}", dst):
            work = dist.isend(t, dst=dst)

        def wait() -> None:
            with _comm(f"sending {what}", dst):
                work.wait()
            del t_kept[:]

        t_kept = [t]  # the tensor stays alive until its send completes
        return wait

    def recv(self, t: torch.Tensor, src: int, what: str) -> torch.Tensor:
        with _comm(f"receiving {what}", src):
            dist.recv(t, src=src)
        return t


class PipelineModel:
    """Rank 0's view of the whole pipeline, usable by :class:`~ds4serve.engine.Engine`."""

    def __init__(self, shard: DeepSeekV4, groups: Groups, table: list[tuple[int, int, int]]):
        if groups.rank != 0:
            raise ValueError("PipelineModel lives on rank 0; other ranks run serve_shard()")
        if groups.world < 2:
            raise ValueError("a pipeline needs at least 2 ranks; use Engine.from_pretrained for one device")
        self.shard = shard
        self.groups = groups
        self.link = _Link(shard, groups)
        self.table = table
        self.cfg: ModelConfig = shard.cfg
        self.layers = range(0, self.cfg.num_layers)
        self.dtype = shard.dtype
        self.device = shard.device
        self._sids = itertools.count(1)
        self._seqs = itertools.count(1)
        self._freed: list[int] = []
        self._broken: str | None = None
        self._workers = "1" if groups.world == 2 else f"1-{groups.world - 1}"

    # ---- control -------------------------------------------------------------------------------
    def _op(self, *op: Any) -> None:
        """Broadcast one operation (and the states freed since the last one) to every rank."""
        if self._broken is not None:
            raise PipelineError(f"pipeline is down: {self._broken}")
        freed = list(self._freed)
        self._freed.clear()
        try:
            with _comm(f"broadcasting {op[0]!r}", self._workers):
                dist.broadcast_object_list([(freed, op)], src=0, group=self.groups.control)
        except PipelineError as exc:
            self._broken = str(exc)
            raise

    def _guarded(self, fn, *args):
        if self._broken is not None:
            raise PipelineError(f"pipeline is down: {self._broken}")
        try:
            return fn(*args)
        except PipelineError as exc:
            self._broken = str(exc)
            raise

    def close(self) -> None:
        """Stop every worker (they return from serve_shard) and leave the process groups."""
        if self._broken is None:
            self._op("stop")
            self._broken = "closed"

    # ---- model interface -----------------------------------------------------------------------
    def new_state(self, max_context: int) -> "PipelineState":
        sid = next(self._sids)
        self._op("new", sid, max_context)
        local = self.shard.new_state(max_context)
        state = PipelineState(
            layers=local.layers, max_context=max_context, window=local.window, sid=sid, model=self
        )
        weakref.finalize(state, self._freed.append, sid)
        return state

    def forward(
        self,
        token_ids: list[int] | torch.Tensor,
        state: "PipelineState",
        *,
        hidden: torch.Tensor | None = None,
        logit_rows: torch.Tensor | slice | None = None,
        capture: tuple[int, ...] = (),
    ) -> ForwardResult:
        if hidden is not None:
            raise ValueError("hidden: the pipeline starts at layer 0 and embeds the tokens itself")
        ids = torch.as_tensor(token_ids, dtype=torch.long).view(-1).tolist()
        if not ids:
            raise ValueError("empty chunk")
        if state.pos + len(ids) > state.max_context:
            raise ValueError(
                f"chunk of {len(ids)} at position {state.pos} exceeds the state's {state.max_context}"
            )
        rows = logit_rows.cpu() if isinstance(logit_rows, torch.Tensor) else logit_rows
        seq = next(self._seqs)
        self._op("forward", state.sid, seq, ids, rows, tuple(capture))
        return self._guarded(self._forward, ids, state, seq, rows, tuple(capture))

    def _forward(
        self, ids: list[int], state: "PipelineState", seq: int, rows: Any, capture: tuple[int, ...]
    ) -> ForwardResult:
        local = self.shard.forward(ids, state, capture=capture)
        self.link.send(local.hidden, 1, "hidden streams")
        captured = dict(local.captured)
        last = self.groups.world - 1
        for rank in range(1, self.groups.world):
            start, stop, _ = self.table[rank]
            for layer in sorted(set(capture) & set(range(start, stop))):
                captured[layer] = self.link.recv(self.link.streams(len(ids)), rank, f"layer {layer} streams")
        final = self.link.recv(self.link.streams(len(ids)), last, "final streams")
        logits = None
        if rows is not None:
            n_rows = torch.arange(len(ids))[rows].numel()
            buf = torch.empty(n_rows, self.cfg.vocab_size, dtype=torch.float32, device=self.device)
            logits = self.link.recv(buf, last, "logits")
        delta = PipelineDelta(
            start=local.delta.start, tokens=local.delta.tokens, layers=local.delta.layers, seq=seq
        )
        return ForwardResult(hidden=final, delta=delta, logits=logits, captured=captured)

    def decode_batch(self, token_ids: list[int], states: list["PipelineState"]) -> BatchForward:
        """One new token for each of N sequences over every rank (:meth:`DeepSeekV4.decode_batch` on each
        rank's layers), in micro-batches (:func:`micro_batches`): rank 0 sends one on and runs the next while
        the ranks after it run the first, so that the ranks work at the same time. Each row's logits are the
        unsplit model's batched step's, bit for bit; writes nothing (commit each row's delta)."""
        ids = [int(t) for t in token_ids]
        if len(ids) != len(states) or not ids:
            raise ValueError(f"decode_batch: {len(ids)} tokens for {len(states)} states")
        seq = next(self._seqs)
        parts = micro_batches(len(ids))
        self._op("decode_batch", [s.sid for s in states], seq, ids, parts)
        return self._guarded(self._decode_batch, ids, states, seq, parts)

    def _decode_batch(
        self, ids: list[int], states: list["PipelineState"], seq: int, parts: list[tuple[int, int]]
    ) -> BatchForward:
        local, sends = [], []
        for a, b in parts:
            out = self.shard.decode_batch(ids[a:b], states[a:b])
            sends.append(self.link.isend(out.hidden, 1, "hidden streams"))
            local.extend(out.deltas)
        last = self.groups.world - 1
        finals, logits = [], []
        for a, b in parts:
            finals.append(self.link.recv(self.link.streams(b - a), last, "final streams"))
            buf = torch.empty(b - a, self.cfg.vocab_size, dtype=torch.float32, device=self.device)
            logits.append(self.link.recv(buf, last, "logits"))
        for wait in sends:
            wait()
        deltas = [PipelineDelta(start=d.start, tokens=d.tokens, layers=d.layers, seq=seq) for d in local]
        return BatchForward(logits=torch.cat(logits), deltas=deltas, hidden=torch.cat(finals))

    def decode_graph(self, state: "PipelineState", graph: bool | None = None) -> "PipelineDecodeGraph":
        """Plain decoding of ``state`` as one CUDA graph per rank (default: on CUDA; ``graph=False``
        runs the same static steps uncaptured, for CPU tests)."""
        return PipelineDecodeGraph(self, state, self.device.type == "cuda" if graph is None else graph)

    def _hand_off(
        self, hidden: torch.Tensor, rows: int, logit_rows: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Send rank 0's output streams on (rank 1 receives them into a replayed step's input); returns the final
        streams of ``rows`` tokens and the logits ``[logit_rows, V]`` from the last rank."""
        link, last = self.link, self.groups.world - 1
        link.send(hidden, 1, "hidden streams")
        final = link.recv(link.streams(rows), last, "final streams")
        buf = torch.empty(logit_rows, self.cfg.vocab_size, dtype=torch.float32, device=self.device)
        return final, link.recv(buf, last, "logits")

    def first_chunks(self, limit: int, graph: bool | None = None) -> "PipelineFirstChunks":
        """A prompt's first prefill chunk as one graph per rank and length bucket (default: captured on CUDA;
        ``graph=False`` runs the same padded forwards uncaptured, for CPU tests)."""
        return PipelineFirstChunks(self, limit, self.device.type == "cuda" if graph is None else graph)

    def verify_graph(
        self, state: "PipelineState", width: int, capture: tuple[int, ...] = (), graph: bool | None = None
    ) -> "PipelineVerifyGraph":
        """Speculative verify blocks of ``width`` over ``state`` as one CUDA graph per rank (default: on
        CUDA; ``graph=False`` runs the same static blocks uncaptured, for CPU tests). They capture no
        layers' streams: model drafts, which need them, need the whole model in one process."""
        if capture:
            raise ValueError(
                "capture: a pipeline's verify graphs capture no layers (model drafts need the "
                "embedding and head in one process)"
            )
        return PipelineVerifyGraph(self, state, width, self.device.type == "cuda" if graph is None else graph)

    def tensors(self) -> list[torch.Tensor]:
        return self.shard.tensors()

    def nbytes(self) -> int:
        """Weight bytes of the whole pipeline (every rank's shard)."""
        return sum(b for _, _, b in self.table)

    # ---- state operations (called by PipelineState) --------------------------------------------
    def _snapshot_parts(self, sid: int) -> dict[int, dict[str, torch.Tensor]]:
        self._op("snapshot", sid)
        layers: dict[int, dict[str, torch.Tensor]] = {}
        for rank in range(1, self.groups.world):
            part: list[Any] = [None]
            self._guarded(_recv_object, part, rank, self.groups)
            layers.update(part[0])
        return layers

    def _restore_parts(self, sid: int, snap: Snapshot) -> None:
        self._op("restore", sid, snap.pos, list(snap.tokens))
        for rank in range(1, self.groups.world):
            start, stop, _ = self.table[rank]
            part = {i: {k: v.cpu() for k, v in snap.layers[i].items()} for i in range(start, stop)}
            self._guarded(_send_object, part, rank, self.groups)


def _recv_object(box: list[Any], src: int, groups: Groups) -> None:
    with _comm("receiving a snapshot", src):
        dist.recv_object_list(box, src=src, group=groups.objects)


def _send_object(obj: Any, dst: int, groups: Groups) -> None:
    with _comm("sending a snapshot", dst):
        dist.send_object_list([obj], dst=dst, group=groups.objects)


@dataclass(eq=False)
class PipelineState(SequenceState):
    """Rank 0's layers of one sequence; every change is mirrored on the other ranks."""

    sid: int = 0
    model: PipelineModel | None = None

    def commit(self, delta: ChunkDelta, n: int, skip: int = 0) -> None:
        if not isinstance(delta, PipelineDelta):
            raise ValueError("delta: expected the delta of a PipelineModel forward")
        super().commit(delta, n, skip)
        self.model._op("commit", self.sid, delta.seq, n, skip)

    def reset(self) -> None:
        super().reset()
        self.model._op("reset", self.sid)

    def snapshot(self, device: torch.device | str | None = None) -> Snapshot:
        snap = super().snapshot(device)
        remote = self.model._snapshot_parts(self.sid)
        if device is not None:
            remote = {i: {k: v.to(device) for k, v in part.items()} for i, part in remote.items()}
        snap.layers.update(remote)
        return snap

    def restore(self, snap: Snapshot) -> None:
        missing = set(self.model.layers) - set(snap.layers)
        if missing:
            raise ValueError(
                f"snapshot covers layers {sorted(snap.layers)}, the pipeline has {self.model.layers}"
            )
        local = Snapshot(
            pos=snap.pos,
            tokens=snap.tokens,
            layers={i: snap.layers[i] for i in self.layers},
            last_logits=snap.last_logits,
        )
        super().restore(local)
        self.model._restore_parts(self.sid, snap)

    def fork(self) -> "PipelineState":
        copy = super().fork()
        sid = next(self.model._sids)
        self.model._op("fork", self.sid, sid)
        state = PipelineState(
            layers=copy.layers,
            max_context=copy.max_context,
            window=copy.window,
            pos=copy.pos,
            last_logits=copy.last_logits,
            tokens=copy.tokens,
            sid=sid,
            model=self.model,
        )
        weakref.finalize(state, self.model._freed.append, sid)
        return state


class PipelineDecodeGraph:
    """Plain decoding over the pipeline: every rank captures the decode step of its layers
    (:class:`~ds4serve.engine.cuda_graphs.DecodeGraph`, its commit included) once, and each step is
    one ``step`` operation: rank 0 replays its graph and sends the streams on, each rank receives them
    into its graph's input buffer and replays, and the last rank returns the final streams and the
    logits. Same interface as :class:`~ds4serve.engine.cuda_graphs.DecodeGraph`."""

    def __init__(self, model: PipelineModel, state: "PipelineState", graph: bool):
        self.model, self.state = model, state
        model._op("graph", state.sid, graph)
        self.local = DecodeGraph(model.shard, state, graph=graph)

    def step(self, token: int) -> ForwardResult:
        """Run ``token`` at ``state.pos`` on every rank and commit it; returns the final streams and the logits
        ``[1, V]`` (no ``choices``: the last rank sends the logits only)."""
        state, model = self.state, self.model
        pos = state.pos
        if pos + 1 > state.max_context:
            raise ValueError(f"decode at position {pos} exceeds the state's {state.max_context}")
        model._op("step", state.sid, token, pos)
        hidden, logits = model._guarded(self._step, token, pos)
        state.advance(token)
        return ForwardResult(
            hidden=hidden, delta=ChunkDelta(start=pos, tokens=[token], layers={}), logits=logits
        )

    def _step(self, token: int, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model._hand_off(self.local.replay(token, pos).hidden, 1, 1)


class PipelineFirstChunks:
    """A prompt's first prefill chunk over the pipeline: every rank holds one
    :class:`~ds4serve.engine.prefill_graphs.ShardFirstChunk` of its layers per length bucket, captured when
    the bucket is first used (or by :meth:`capture_all`). A chunk is one ``first`` operation: the streams of
    the padded chunk go rank to rank as in a forward, the last rank returns the final streams and the logits
    of the last real row, and each rank keeps its delta until rank 0 commits it. A rank whose experts a
    capture cannot take runs its padded forward uncaptured: the same rows. Same interface as
    :class:`~ds4serve.engine.prefill_graphs.FirstChunkGraphs`."""

    def __init__(self, model: PipelineModel, limit: int, graph: bool):
        self.model, self.limit, self.graph = model, limit, graph
        self._parts: dict[int, ShardFirstChunk] = {}
        self._pool = first_chunk_pool(model.shard, graph)

    def applies(self, state: SequenceState, n: int) -> bool:
        """Whether a chunk of ``n`` tokens at ``state.pos`` runs through a graph."""
        return first_chunk_applies(state, n, self.limit)

    def capture_all(self) -> int:
        """Capture every bucket's graphs not captured yet, on every rank (a server's warm-up: one padding chunk
        per bucket over a scratch state, never committed); returns how many buckets were captured."""
        missing = [width for width in buckets(self.limit) if width not in self._parts]
        for width in missing:
            self.forward([PAD_TOKEN] * width, self.model.new_state(width))
        return len(missing)

    def forward(self, ids: list[int], state: "PipelineState") -> ForwardResult:
        """The forward of ``ids`` at position 0 (:meth:`applies`), uncommitted: logits of its last row
        ``[1, V]`` and the final streams of its ``len(ids)`` rows, in buffers the next chunk of the same
        bucket overwrites; the delta holds rank 0's layers (commit it before the next chunk)."""
        if not self.applies(state, len(ids)):
            raise ValueError(
                f"a first-chunk graph takes 1..{self.limit} tokens at position 0, "
                f"got {len(ids)} at {state.pos}"
            )
        model = self.model
        width = bucket_of(len(ids), self.limit)
        seq = next(model._seqs)
        model._op("first", state.sid, seq, list(ids), width, self.graph)
        return model._guarded(self._forward, list(ids), seq, width)

    def _forward(self, ids: list[int], seq: int, width: int) -> ForwardResult:
        part = self._parts.get(width)
        if part is None:
            part = self._parts[width] = first_chunk_part(
                self.model.shard, width, self._pool, self.graph, None
            )
        out = part.run(ids)
        final, logits = self.model._hand_off(out.hidden, len(ids), 1)
        delta = PipelineDelta(start=0, tokens=list(ids), layers=out.delta.layers, seq=seq)
        return ForwardResult(hidden=final, delta=delta, logits=logits)


def first_chunk_pool(shard: DeepSeekV4, graph: bool) -> object | None:
    """The memory pool a rank's first-chunk graphs share (they never run at the same time)."""
    return torch.cuda.graph_pool_handle() if graph and shard.device.type == "cuda" else None


def first_chunk_part(
    shard: DeepSeekV4, width: int, pool: object | None, graph: bool, hidden: torch.Tensor | None
) -> ShardFirstChunk:
    """A rank's first-chunk forward of ``width`` tokens, captured where ``graph`` asks and its experts allow."""
    return ShardFirstChunk(shard, width, pool, graph and shard_capturable(shard), hidden)


class PipelineVerifyGraph:
    """Speculative verify blocks of ``width`` over the pipeline: every rank captures the static block of its
    layers (:class:`~ds4serve.engine.cuda_graphs.VerifyGraph`) once. A run is one ``verify`` operation (the
    streams go rank to rank as in a decode step, the last rank returns the final streams and every row's
    logits); the accepted prefix is one ``vcommit`` operation: each rank's captured device writes of that
    many rows, then its host counters. Same interface as :class:`~ds4serve.engine.cuda_graphs.VerifyGraph`
    (the engine commits an accepted prefix through :meth:`commit`)."""

    def __init__(self, model: PipelineModel, state: "PipelineState", width: int, graph: bool):
        self.model, self.state, self.width = model, state, width
        model._op("vgraph", state.sid, width, graph)
        self.local = VerifyGraph(model.shard, state, width, graph=graph)

    def run(self, block: list[int]) -> ForwardResult:
        """Every row's logits ``[width, V]`` and final streams of ``block`` at ``state.pos`` (buffers the
        next run overwrites); the delta holds rank 0's layers only, :meth:`commit` commits every rank's."""
        state, model = self.state, self.model
        if len(block) != self.width or state.pos + self.width > state.max_context:
            raise ValueError(
                f"verify graph of width {self.width}: got {len(block)} tokens at position "
                f"{state.pos} of a state of {state.max_context}"
            )
        model._op("verify", state.sid, self.width, list(block), state.pos)
        return model._guarded(self._run, block, state.pos)

    def _run(self, block: list[int], pos: int) -> ForwardResult:
        out = self.local.replay(block, pos)
        final, logits = self.model._hand_off(out.hidden, self.width, self.width)
        return ForwardResult(hidden=final, delta=out.delta, logits=logits, captured={})

    def commit(self, tokens: list[int]) -> None:
        """The last block's first ``len(tokens)`` rows committed on every rank."""
        self.model._op("vcommit", self.state.sid, self.width, list(tokens))
        self.model._guarded(self.local.write, len(tokens))
        self.state.advance_block(tokens)


def serve_shard(shard: DeepSeekV4, groups: Groups, table: list[tuple[int, int, int]]) -> None:
    """A worker rank's loop: apply rank 0's operations (:attr:`_ShardServer.HANDLERS`) until it says stop.
    ``table`` is :func:`shard_handshake`'s (a worker talks to its neighbours only).

    Raises :class:`PipelineError` when rank 0 or a neighbour dies or stops answering.
    """
    server = _ShardServer(shard, groups)
    with torch.inference_mode():
        while True:
            box: list[Any] = [None]
            with _comm("waiting for the next operation", 0):
                dist.broadcast_object_list(box, src=0, group=groups.control)
            freed, op = box[0]
            server.free(freed)
            kind, args = op[0], op[1:]
            if kind == "stop":
                return
            handler = _ShardServer.HANDLERS.get(kind)
            if handler is None:
                raise PipelineError(f"pipeline: unknown operation {kind!r} from rank 0")
            handler(server, *args)


class _ShardServer:
    """A worker rank's states and graphs, and one handler per operation of rank 0 (:attr:`HANDLERS`).

    Each sequence ``sid`` has this rank's state of it, the deltas of its forwards not yet committed (by
    forward ``seq``), its decode graph and its verify graphs by width. A handler applies one operation with
    the arguments rank 0 sent; those that run a forward take the streams from the rank before and send theirs
    on (the last rank: the final streams and the logits to rank 0).
    """

    def __init__(self, shard: DeepSeekV4, groups: Groups):
        self.shard = shard
        self.link = _Link(shard, groups)
        self.groups = groups
        self.rank, self.last = groups.rank, groups.world - 1
        self.states: dict[int, SequenceState] = {}
        self.pending: dict[int, dict[int, ChunkDelta]] = {}
        self.graphs: dict[int, DecodeGraph] = {}  # sid -> the decode step of this rank's layers
        self.verify_graphs: dict[tuple[int, int], VerifyGraph] = {}  # (sid, width) -> its verify block
        self.first_chunks: dict[int, ShardFirstChunk] = {}  # bucket width -> the first chunk of its layers
        self.first_pool: object | None = None  # their graphs' memory pool

    def free(self, sids: list[int]) -> None:
        """Drop the states rank 0 freed, with their pending deltas and graphs."""
        for sid in sids:
            self.states.pop(sid, None)
            self.pending.pop(sid, None)
            self.graphs.pop(sid, None)
            for key in [k for k in self.verify_graphs if k[0] == sid]:
                del self.verify_graphs[key]

    def _pass_on(self, hidden: torch.Tensor, run: Callable[[], ForwardResult], rows: int) -> ForwardResult:
        """Receive the streams into ``hidden`` (a step's input buffer), ``run`` the step and send its
        output on: to the next rank, or from the last rank the first ``rows`` final streams and the logits
        to rank 0."""
        link, rank = self.link, self.rank
        link.recv(hidden, rank - 1, "hidden streams")
        out = run()
        if rank == self.last:
            link.send(out.hidden[:rows], 0, "final streams")
            link.send(out.logits, 0, "logits")
        else:
            link.send(out.hidden, rank + 1, "hidden streams")
        return out

    def new(self, sid: int, max_context: int) -> None:
        self.states[sid] = self.shard.new_state(max_context)
        self.pending[sid] = {}

    def forward(self, sid: int, seq: int, ids: list[int], rows: Any, capture: tuple[int, ...]) -> None:
        """An eager forward of this rank's layers, kept as pending ``seq`` until rank 0 commits it."""
        link, rank, state = self.link, self.rank, self.states[sid]
        hidden = link.recv(link.streams(len(ids)), rank - 1, "hidden streams")
        with profiler.step("decode" if len(ids) == 1 else "prefill", len(ids), state.pos, self.shard.layers):
            out = self.shard.forward(
                ids, state, hidden=hidden, logit_rows=rows if rank == self.last else None, capture=capture
            )
        self.pending[sid][seq] = out.delta
        for layer in sorted(out.captured):
            link.send(out.captured[layer], 0, f"layer {layer} streams")
        if rank == self.last:
            link.send(out.hidden, 0, "final streams")
            if out.logits is not None:
                link.send(out.logits, 0, "logits")
        else:
            link.send(out.hidden, rank + 1, "hidden streams")

    def decode_batch(self, sids: list[int], seq: int, ids: list[int], parts: list[tuple[int, int]]) -> None:
        """A batched step of this rank's layers, micro-batch by micro-batch as rank 0 sends them; each row's
        delta kept as its sequence's pending ``seq``."""
        link, rank = self.link, self.rank
        sends = []
        for a, b in parts:
            hidden = link.recv(link.streams(b - a), rank - 1, "hidden streams")
            states = [self.states[sid] for sid in sids[a:b]]
            with profiler.step("decode", b - a, min(s.pos for s in states), self.shard.layers):
                out = self.shard.decode_batch(ids[a:b], states, hidden=hidden)
            for sid, delta in zip(sids[a:b], out.deltas):
                self.pending[sid][seq] = delta
            if rank == self.last:
                sends.append(link.isend(out.hidden, 0, "final streams"))
                sends.append(link.isend(out.logits, 0, "logits"))
            else:
                sends.append(link.isend(out.hidden, rank + 1, "hidden streams"))
        for wait in sends:
            wait()

    def decode_graph(self, sid: int, graph: bool) -> None:
        self.graphs[sid] = DecodeGraph(
            self.shard, self.states[sid], hidden=torch.zeros_like(self.link.streams(1)), graph=graph
        )

    def step(self, sid: int, token: int, pos: int) -> None:
        """A decode graph's step, its commit included."""
        step = self.graphs[sid]
        self._pass_on(step.hidden, lambda: step.replay(token, pos), 1)
        self.states[sid].advance(token)
        self.pending[sid] = {}

    def first(self, sid: int, seq: int, ids: list[int], width: int, graph: bool) -> None:
        """A prompt's first chunk padded to ``width``, kept as pending ``seq``."""
        part = self.first_chunks.get(width)
        if part is None:
            if self.first_pool is None:
                self.first_pool = first_chunk_pool(self.shard, graph)
            part = self.first_chunks[width] = first_chunk_part(
                self.shard, width, self.first_pool, graph, torch.zeros_like(self.link.streams(width))
            )
        out = self._pass_on(part.hidden, lambda: part.run(ids), len(ids))
        self.pending[sid][seq] = ChunkDelta(start=0, tokens=list(ids), layers=out.delta.layers)

    def verify_graph(self, sid: int, width: int, graph: bool) -> None:
        self.verify_graphs[sid, width] = VerifyGraph(
            self.shard,
            self.states[sid],
            width,
            graph=graph,
            hidden=torch.zeros_like(self.link.streams(width)),
        )

    def verify(self, sid: int, width: int, block: list[int], pos: int) -> None:
        block_graph = self.verify_graphs[sid, width]
        self._pass_on(block_graph.hidden, lambda: block_graph.replay(block, pos), width)
        self.pending[sid] = {}

    def verify_commit(self, sid: int, width: int, tokens: list[int]) -> None:
        """The last verify block's first ``len(tokens)`` rows: device writes, then the host counters."""
        self.verify_graphs[sid, width].write(len(tokens))
        self.states[sid].advance_block(tokens)

    def commit(self, sid: int, seq: int, n: int, skip: int = 0) -> None:
        delta = self.pending[sid][seq]
        self.states[sid].commit(delta, n, skip)
        self.pending[sid] = {seq: delta}  # the chunk's next part may follow; the next chunk's commit drops it

    def reset(self, sid: int) -> None:
        self.states[sid].reset()
        self.pending[sid] = {}

    def snapshot(self, sid: int) -> None:
        _send_object(self.states[sid].snapshot("cpu").layers, 0, self.groups)

    def restore(self, sid: int, pos: int, tokens: list[int]) -> None:
        part: list[Any] = [None]
        _recv_object(part, 0, self.groups)
        self.states[sid].restore(Snapshot(pos=pos, tokens=tokens, layers=part[0]))
        self.pending[sid] = {}

    def fork(self, src: int, sid: int) -> None:
        self.states[sid] = self.states[src].fork()
        self.pending[sid] = {}

    HANDLERS: dict[str, Callable[..., None]] = {
        "new": new,
        "forward": forward,
        "decode_batch": decode_batch,
        "graph": decode_graph,
        "step": step,
        "first": first,
        "vgraph": verify_graph,
        "verify": verify,
        "vcommit": verify_commit,
        "commit": commit,
        "reset": reset,
        "snapshot": snapshot,
        "restore": restore,
        "fork": fork,
    }
