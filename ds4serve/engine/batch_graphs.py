"""Batched decode steps over fixed decode slots, captured as one CUDA graph per batch bucket.

A CUDA graph reads the tensors it was captured with, so the sequences of a batched step must sit in fixed
states. :class:`DecodeSlots` holds ``count`` states of one capacity and keeps the decoding sequences packed in
its lowest slots: a sequence enters (its prefilled state copied into the next free slot) when it starts
decoding, and when one leaves, the last one moves into its slot (a copy of what it has used).

:class:`BatchGraphs` runs a step of N sequences as the graph of the smallest bucket B >= N (:data:`BUCKETS`)
over slots 0..B-1: the static batched forward (:func:`ds4serve.model.batch.decode_batch` with positions) and
every row's commit at its device position. Rows N..B-1 forward token 0 at position 0 on free slots, whose
contents nothing reads before the next :meth:`DecodeSlots.enter` overwrites them. Every row is what it is in
any bucket (the batched forward's tile rule), so a sequence's tokens do not depend on what runs beside it.
With ``graph=False`` (a device without CUDA graphs) each step runs the same static forward uncaptured.

A layer split in this process (:class:`~ds4serve.parallel.SplitModel`) gets one such step per shard, each over
its shard's part of the slots, captured on the shard's device and replayed in layer order, the streams leaving
a shard copied into the next one's input buffer. Its bucket runs as two micro-batches
(:func:`~ds4serve.model.batch.micro_batches`): a replay returns before the device has run it, so while the next
shard runs the first micro-batch, the first shard runs the second.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..devices import ids_on, on_device
from ..model import DeepSeekV4
from ..model.batch import BatchForward, micro_batches
from ..parallel.split_model import SplitModel
from ..state import SequenceState
from .cuda_graphs import Captured, with_choices
from .device_commit import DeviceCommit

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)  # rows of the captured steps (and the slot count)


@dataclass
class DecodedRows:
    """A decode step's rows (:meth:`~ds4serve.engine.engine.Engine.decode_rows`): each row's logits ``[V]``, kept
    past the next step, and where the captured step took it their argmax on the device, ``choices``, a buffer the
    next step overwrites: row ``i``'s at ``choices[order[i]]`` (``order`` None: at ``i``)."""

    logits: list[torch.Tensor]
    choices: torch.Tensor | None = None
    order: list[int] | None = None

    def chosen(self, argmax: list[int], drawn: dict[int, torch.Tensor]) -> dict[int, int]:
        """The tokens of the rows decided on the device, by row (indices into :attr:`logits`), read back in one
        wait: the argmax of each of ``argmax`` (the step's ``choices``, or one argmax over those rows' logits where
        the step took none) and the ``[1]`` tokens ``drawn`` (sampled rows' draws, by row)."""
        parts = [t.view(1) for t in drawn.values()]
        if argmax:  # the step's choices are every row's, in its order; an argmax taken here, the rows'
            parts.insert(0, self.choices if self.choices is not None else self._argmax(argmax))
        if not parts:
            return {}
        ids = (parts[0] if len(parts) == 1 else torch.cat([t.to(parts[0].device) for t in parts])).tolist()
        head = len(ids) - len(drawn)
        out = dict(zip(drawn, ids[head:]))
        if argmax and self.choices is not None:
            out.update((i, ids[i if self.order is None else self.order[i]]) for i in argmax)
        elif argmax:
            out.update(zip(argmax, ids[:head]))
        return out

    def _argmax(self, rows: list[int]) -> torch.Tensor:
        return torch.stack([self.logits[i] for i in rows]).argmax(-1)


def bucket_for(rows: int, slots: int) -> int:
    """The rows of the step that decodes ``rows`` sequences: the smallest bucket that holds them, at most
    ``slots``."""
    return min([b for b in BUCKETS if b >= rows] + [slots])


class DecodeSlots:
    """``count`` sequence states of one capacity; the decoding sequences occupy slots ``0 .. used - 1``."""

    def __init__(self, allocate: Callable[[], SequenceState], count: int):
        if count < 1:
            raise ValueError(f"count: expected >= 1, got {count}")
        self.states = [allocate() for _ in range(count)]
        self.used = 0

    def index(self, slot: SequenceState) -> int:
        for i in range(self.used):
            if self.states[i] is slot:
                return i
        raise ValueError("not a slot in use")

    def enter(self, state: SequenceState) -> SequenceState:
        """The next free slot, now holding a copy of ``state`` (its host counters and last logits included)."""
        if self.used == len(self.states):
            raise RuntimeError(f"all {self.used} decode slots are in use")
        slot = self.states[self.used]
        if state.pos > slot.max_context:
            raise ValueError(f"a sequence of {state.pos} tokens does not fit a slot of {slot.max_context}")
        slot.restore(state.snapshot())
        self.used += 1
        return slot

    def leave(self, slot: SequenceState) -> SequenceState | None:
        """Free ``slot``. When it was not the last one in use, the last one's sequence moves into it: returns
        the state that held it (its owner now finds it in ``slot``); else None."""
        i, last = self.index(slot), self.used - 1
        self.used -= 1
        if i == last:
            return None
        moved = self.states[last]
        slot.restore(moved.snapshot())
        return moved


class BatchGraphs:
    """The batched decode steps of ``model`` (a whole model or a layer split) over ``slots``, one captured
    step per bucket (made on first use or by :meth:`capture`); the graphs of a device share one memory pool
    (they run one after another on its stream)."""

    def __init__(self, model: DeepSeekV4 | SplitModel, slots: DecodeSlots, graph: bool = True):
        self.model, self.slots, self.graph = model, slots, graph
        self._shards: list[DeepSeekV4] = model.shards if isinstance(model, SplitModel) else [model]
        self._steps: dict[int, list[_MicroBatch]] = {}
        self._pools = {s.device: _pool(s.device) if graph else None for s in self._shards}

    def capture(self) -> None:
        """Capture the step of every bucket up to the slot count (the engine's warm-up)."""
        for rows in sorted(
            {bucket_for(n, len(self.slots.states)) for n in range(1, len(self.slots.states) + 1)}
        ):
            self._step(rows)

    def step(self, slots: list[SequenceState], tokens: list[int]) -> DecodedRows:
        """Forward ``tokens[i]`` on ``slots[i]`` (every slot in use, in any order), commit each; returns each
        row's logits ``[V]`` (float32) and their argmax."""
        used = self.slots.used
        if len(slots) != used:
            raise ValueError(f"a batched step decodes every slot in use: got {len(slots)} of {used}")
        rows = bucket_for(used, len(self.slots.states))
        order = [self.slots.index(s) for s in slots]
        ids, positions = [0] * rows, [0] * rows
        for i, slot, token in zip(order, slots, tokens):
            if slot.pos + 1 > slot.max_context:
                raise ValueError(f"decode at position {slot.pos} exceeds the slot's {slot.max_context}")
            ids[i], positions[i] = token, slot.pos
        batches = self._step(rows)
        for batch in batches:  # every input first: a host-to-device copy waits for its device
            batch.fill(ids, positions)
        outs = [batch.replay() for batch in batches]
        logits = torch.cat([out.logits[: max(0, used - batch.start)] for out, batch in zip(outs, batches)])
        choices = outs[0].choices if len(outs) == 1 else torch.cat([out.choices for out in outs])
        rows = []
        for i, slot, token in zip(order, slots, tokens):
            slot.advance(token)
            slot.last_logits = logits[i]
            rows.append(logits[i])
        return DecodedRows(rows, choices, order)

    def _step(self, rows: int) -> list["_MicroBatch"]:
        step = self._steps.get(rows)
        if step is None:
            parts = micro_batches(rows) if len(self._shards) > 1 else [(0, rows)]
            step = self._steps[rows] = [
                _MicroBatch(self._shards, self.slots.states[a:b], a, self.graph, self._pools)
                for a, b in parts
            ]
        return step


def _pool(device: torch.device) -> object:
    with on_device(device):
        return torch.cuda.graph_pool_handle()


class _MicroBatch:
    """Slots ``start ..`` of a bucket through every shard: one :class:`_ShardStep` per shard, replayed in
    layer order."""

    def __init__(
        self,
        shards: list[DeepSeekV4],
        slots: list[SequenceState],
        start: int,
        graph: bool,
        pools: dict[torch.device, object | None],
    ):
        self.start, self.rows = start, len(slots)
        self.shards: list[_ShardStep] = []
        for k, shard in enumerate(shards):
            with on_device(shard.device):
                parts = slots if len(shards) == 1 else [s.part(shard.layers) for s in slots]
                self.shards.append(_ShardStep(shard, parts, graph, pools[shard.device], first=k == 0))

    def fill(self, ids: list[int], positions: list[int]) -> None:
        """The bucket's tokens and positions (every row's): this micro-batch's go to each shard's inputs."""
        a, b = self.start, self.start + self.rows
        inputs = ids_on(ids[a:b] + positions[a:b], self.shards[0].inputs.device)
        for step in self.shards:
            step.inputs.copy_(inputs)

    def replay(self) -> BatchForward:
        """Run the filled rows through every shard, committing each; the last shard's result (the logits
        ``[rows, V]`` and their argmax), buffers that the next replay overwrites."""
        out = None
        for step in self.shards:
            with on_device(step.model.device):
                if out is not None:
                    step.hidden.copy_(out.hidden)
                out = step.replay()
        return out


class _ShardStep:
    """The static batched forward of one shard (a whole model: all its layers) over ``slots`` and each row's
    commit, captured (or not). Past the first shard the incoming streams are read from ``hidden``."""

    def __init__(
        self, model: DeepSeekV4, slots: list[SequenceState], graph: bool, pool: object | None, first: bool
    ):
        self.model, self.slots = model, slots
        device = model.device
        n = len(slots)
        cfg = model.cfg
        self.hidden = (
            None if first else torch.zeros(n, cfg.hc_mult, cfg.hidden_size, dtype=model.dtype, device=device)
        )
        self.inputs = torch.zeros(2 * n, dtype=torch.long, device=device)  # the tokens, then the positions
        # one tensor per row: a row's compiled regions then see the same tensor shape and offset in every row
        self.positions = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(n)]
        self._writes = [DeviceCommit(s) for s in slots]
        self._run = Captured(
            self._forward_and_commit,
            device,
            graph=graph,
            warm=self._forward,
            setup=self._prepare,
            pool=pool,
        )
        for writes in self._writes:
            writes.finish_capture()

    def _prepare(self) -> list[torch.Tensor | None]:
        return [w.prepare_capture(p) for w, p in zip(self._writes, self.positions)]

    def _forward(self) -> BatchForward:
        n = len(self.slots)
        for r, pos in enumerate(self.positions):
            pos.copy_(self.inputs[n + r : n + r + 1])
        return self.model.decode_batch(
            self.inputs[:n], self.slots, hidden=self.hidden, positions=self.positions
        )

    def _forward_and_commit(self) -> BatchForward:
        out = with_choices(self._forward())
        for writes, delta, pos in zip(self._writes, out.deltas, self.positions):
            writes.write_token(delta, pos)
        return out

    def replay(self) -> BatchForward:
        """Forward the inputs and commit them: buffers that the next replay overwrites."""
        return self._run.replay()
