"""The engine: one model, exact chunked prefill and decode, many sequences through one step loop.

Requests go through :mod:`.step_loop` (admission, chunked prefill, batched decode, retirement), which
:meth:`Engine.generate` drives for a lone caller and the server drives for all of its clients. Every
request starts from a clean :class:`~ds4serve.state.SequenceState` or from a restored
:class:`~ds4serve.state.Snapshot` whose tokens are a prefix of the prompt (then only the suffix is
prefilled; an exact-prefix restore forwards nothing and samples from the snapshot's last logits).
Failures never escape :meth:`Engine.generate`: they come back as a :class:`GenerateResult` with an
:class:`ErrorCode`.

On CUDA every step runs as a CUDA graph (decode, speculative verify, a prompt's first prefill chunk, the
draft passes) unless the engine is ``eager``: that one flag, given when the engine is built, decides them
all. Speculative decoding and the drafts use the engine through :meth:`Engine.require_model`,
:meth:`Engine.verify` and its public attributes (``cfg``, ``tokenizer``, ``eager``, ``path``, ``draft``).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import threading
import time
from pathlib import Path
from typing import Callable

import torch

from .. import profiler
from ..config import ModelConfig
from ..kernels import config as kernel_config
from ..kernels.config import KernelConfig
from ..model import DeepSeekV4, ForwardResult
from ..parallel.pipeline import PipelineDecodeGraph, PipelineFirstChunks, PipelineModel, PipelineVerifyGraph
from ..parallel.split_model import SplitModel
from ..state import SequenceState, Snapshot, state_nbytes
from ..tokenizer import Tokenizer
from ..weights import Checkpoint
from . import cuda_graphs
from .batch_graphs import BatchGraphs, DecodedRows, DecodeSlots
from .constraint import prepare as prepare_constraints
from .cuda_graphs import DecodeGraph, SplitDecodeGraph, SplitVerifyGraph, VerifyGraph
from .prefill_graphs import MAX_GRAPH_TOKENS, FirstChunkGraphs
from .prefill_graphs import graphs_apply as prefill_graphs_apply
from .request import ErrorCode, GenerateError, GenerateResult, SamplingParams
from .speculative import PromptFeed
from .state_pool import StatePool
from .step_loop import RequestHandle, StepLoop, StepReport, check_prefill_tokens, even_chunks

log = logging.getLogger("ds4serve.engine")
WARM_UP_PROMPT, WARM_UP_TOKENS = 16, 4  # Engine.warm_up's request: a prefill chunk and a few decode steps

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
PARK_SELECTORS = ("", "all", "target", "draft")
DEFAULT_MAX_BATCH = 16  # sequences a decode step takes where the engine batches (see Engine.__init__)
SLOT_MEMORY_FRACTION = 0.5  # of a GPU's free memory, what the default decode slots may take
GPU_CHUNK_TOKENS, CPU_CHUNK_TOKENS = 4096, 512  # default longest prefill chunk (see default_chunk_size)


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


class Engine:
    """DeepSeek-V4 inference over one model (or one layer split) with exact incremental state."""

    def __init__(
        self,
        model: DeepSeekV4,
        tokenizer: Tokenizer,
        *,
        loader: Callable[[], DeepSeekV4] | None = None,
        path: Path | None = None,
        max_context: int | None = None,
        chunk_size: int = 512,
        eager: bool = False,
        kernels: KernelConfig | None = None,
        max_batch: int | None = None,
        max_prefill_tokens: int | None = None,
        slot_memory_fraction: float | None = None,
    ):
        """``max_batch``: the most sequences that run at once (decoded together in one batched forward);
        default :data:`DEFAULT_MAX_BATCH`, on GPUs as many decode slots of ``max_context`` tokens as
        :func:`default_max_batch` fits in the free memory of each (a layer split's share of a slot on each
        of its devices), and 1 in a pipeline on GPUs (its batched steps are not captured). An engine with
        ``max_batch`` 1 decodes through the one-sequence step, any other through the batched one, a lone sequence included, so that a
        sequence's results never depend on what runs beside it. ``slot_memory_fraction``: the share of a GPU's
        free memory that the default decode slots may take (0 < fraction <= 1; default
        :data:`SLOT_MEMORY_FRACTION`).
        ``max_prefill_tokens``: prompt tokens forwarded per step, at least one chunk (default ``chunk_size``)."""
        if chunk_size < 1:
            raise ValueError(f"chunk_size: expected an integer >= 1, got {chunk_size}")
        slot_memory_fraction = SLOT_MEMORY_FRACTION if slot_memory_fraction is None else slot_memory_fraction
        if not 0 < slot_memory_fraction <= 1:
            raise ValueError(f"slot_memory_fraction: expected 0 < fraction <= 1, got {slot_memory_fraction}")
        self.model: DeepSeekV4 | None = model
        self.cfg: ModelConfig = model.cfg
        self.tokenizer = tokenizer
        self.path = path
        self._loader = loader
        self.device = model.device
        self.dtype = model.dtype
        self.max_context = max_context or self.cfg.max_position_embeddings
        if self.max_context > self.cfg.max_position_embeddings:
            log.warning(
                "max_context %d is past the checkpoint's max_position_embeddings %d: positions beyond it are "
                "outside what the model was trained on",
                self.max_context,
                self.cfg.max_position_embeddings,
            )
        self.chunk_size = chunk_size
        self.draft = None  # a draft model with park()/unpark(), set by speculative decoding
        self.prefix_cache = None  # a PrefixCache the step loop restores from and fills (set by the server)
        self._state: SequenceState | None = None  # the state of the request admitted last
        self._pending_restore: Snapshot | None = None
        self._lock = threading.RLock()
        self.forward_calls = 0
        self.verifies = 0  # verify forwards run (a verify launched ahead is current while this stays)
        # True: no CUDA graphs (decode, verify, first prefill chunks, draft passes); on CUDA they are used
        # otherwise, and on other devices every step is eager anyway (the --eager flag)
        self.eager = eager
        # which implementation every forward runs (Triton or the torch reference, PDL): process-wide,
        # installed here when given, read only through ds4serve.kernels.config
        self.kernels = kernel_config.install(kernels) if kernels else kernel_config.current()
        self._graph: DecodeGraph | SplitDecodeGraph | PipelineDecodeGraph | None = None
        self._first_chunks: FirstChunkGraphs | PipelineFirstChunks | None = None  # by bucket
        # (model, eager, whether its first chunks are captured): judged once per model, not per prompt
        self._first_chunks_apply: tuple[object, bool, bool] | None = None
        # (id of its state, width, capture) -> a verify graph, the least recently used first
        self._verify_graphs: dict[
            tuple[int, int, tuple[int, ...]], VerifyGraph | SplitVerifyGraph | PipelineVerifyGraph
        ] = {}
        self._verify_pool: object | None = None  # the memory pool a whole model's verify graphs share
        if max_batch is None:
            max_batch = self._default_max_batch(model, slot_memory_fraction)
        self.max_batch = max_batch
        self._batch: BatchGraphs | None = None  # the decode slots and their batched steps (see _batch_graphs)
        self._states = StatePool(self.new_sequence, self.max_context, max_batch, self._forget_state)
        self._loop = StepLoop(self, max_batch, max_prefill_tokens or chunk_size)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype = "float32",
        *,
        max_context: int | None = None,
        chunk_size: int | None = None,
        devices: list[str | torch.device] | None = None,
        layer_split: list[int] | None = None,
        quantized: bool | None = None,
        eager: bool = False,
        kernels: KernelConfig | None = None,
        max_batch: int | None = None,
        max_prefill_tokens: int | None = None,
        slot_memory_fraction: float | None = None,
    ) -> "Engine":
        """Load a checkpoint on ``device``, or split its layers over ``devices`` (see docs/PARALLEL.md).

        ``quantized`` keeps FP8 / MXFP4 tensors quantized in memory, read in place by the GPU kernels
        (default: on CUDA devices; elsewhere they are dequantised once at load, exactly);
        ``chunk_size`` is the longest prefill chunk (default :func:`default_chunk_size`);
        ``eager`` runs every step without CUDA graphs; ``kernels``, when given, is installed as the
        process's kernel configuration (Triton kernels or the torch reference, PDL); ``max_batch``,
        ``max_prefill_tokens`` and ``slot_memory_fraction`` as in :class:`Engine`.
        """
        on_cuda = torch.device((devices or [device])[0]).type == "cuda"
        if quantized is None:
            quantized = on_cuda
        path = Path(path)
        torch_dtype = resolve_dtype(dtype)
        if layer_split is not None and devices is None:
            raise ValueError("layer_split: needs devices=[...] naming one device per layer range")

        def load() -> DeepSeekV4:
            return DeepSeekV4.load(Checkpoint(path), dtype=torch_dtype, device=device, quantized=quantized)

        if devices is not None:
            from ..parallel import split_loader

            load = split_loader(
                path,
                devices,
                torch_dtype,
                layer_split=layer_split,
                max_context=max_context,
                quantized=quantized,
            )
        return cls(
            load(),
            Tokenizer(path),
            loader=load,
            path=path,
            max_context=max_context,
            chunk_size=chunk_size or default_chunk_size(on_cuda),
            eager=eager,
            kernels=kernels,
            max_batch=max_batch,
            max_prefill_tokens=max_prefill_tokens,
            slot_memory_fraction=slot_memory_fraction,
        )

    # ---- forward helpers -----------------------------------------------------------------------
    def _forward(
        self,
        ids: list[int],
        state: SequenceState,
        logit_rows: torch.Tensor | slice | None,
        capture: tuple[int, ...] = (),
    ):
        self.forward_calls += 1
        return self.require_model().forward(ids, state, logit_rows=logit_rows, capture=capture)

    def prefill(
        self,
        state: SequenceState,
        ids: list[int],
        chunk_sizes: list[int] | None = None,
        all_logits: bool = False,
        on_chunk: "PromptFeed | None" = None,
        cancel: threading.Event | None = None,
        pauses: tuple[int, ...] = (),
        at_pause: Callable[[SequenceState], None] | None = None,
    ) -> torch.Tensor | None:
        """Forward ``ids`` chunk by chunk, committing each chunk.

        Returns the last position's logits ``[V]`` (or every position's ``[N, V]`` with
        ``all_logits``). Intermediate chunks skip the output head. ``on_chunk`` receives each
        committed chunk's forward result (with the layers it asks to capture; a first chunk runs through
        its captured graph unless it asks for layers, its streams then copied out of the graph's buffer).
        ``cancel`` set before a chunk raises a CANCELLED :class:`GenerateError` (the state keeps the chunks done).
        ``at_pause(state)`` is called where the state holds the first ``p`` tokens, for each ``p`` of
        ``pauses`` inside a chunk (the chunk is committed in parts there; it is forwarded once).
        """
        capture = () if on_chunk is None else on_chunk.capture_layers
        sizes = chunk_sizes or even_chunks(len(ids), self.chunk_size)
        graphs = None if all_logits or capture else self._prefill_graphs()
        outs: list[torch.Tensor] = []
        offset = 0
        for n, size in enumerate(sizes):
            if cancel is not None and cancel.is_set():
                raise GenerateError(
                    ErrorCode.CANCELLED, f"cancelled during prefill, {offset} of {len(ids)} tokens done"
                )
            chunk = ids[offset : offset + size]
            last = n == len(sizes) - 1
            rows = slice(None) if all_logits else (slice(size - 1, size) if last else None)
            start = state.pos
            if graphs is not None and graphs.applies(state, size):
                self.forward_calls += 1
                with profiler.step("prefill", size, state.pos, graphs.model.layers, graph=True):
                    result = graphs.forward(chunk, state)
                result.logits = result.logits.clone() if last else None  # the graph's buffer is reused
                if on_chunk is not None and result.hidden is not None:  # kept until the first token is chosen
                    result.hidden = result.hidden.clone()
            else:
                with profiler.step("prefill", size, state.pos, self.require_model().layers):
                    result = self._forward(chunk, state, rows, capture)
            done = 0
            for p in sorted(p for p in pauses if start < p < start + size):
                state.commit(result.delta, p - start - done, skip=done)
                done = p - start
                state.last_logits = None  # not computed there
                at_pause(state)
            state.commit(result.delta, size - done, skip=done)
            if on_chunk is not None:
                on_chunk(start, chunk, result)
            if result.logits is not None:
                outs.append(result.logits)
            offset += size
        logits = torch.cat(outs) if outs else None
        if logits is not None:
            state.last_logits = logits[-1]
        return logits if all_logits else state.last_logits

    def score(self, token_ids: list[int], chunk_sizes: list[int] | None = None) -> torch.Tensor:
        """float32 logits ``[len(token_ids), vocab]`` at every position, for any chunking."""
        ids = [int(t) for t in token_ids]
        if not ids:
            raise ValueError("token_ids: expected at least one token")
        if chunk_sizes is not None and (sum(chunk_sizes) != len(ids) or min(chunk_sizes) < 1):
            raise ValueError(f"chunk_sizes: expected positive sizes summing to {len(ids)}, got {chunk_sizes}")
        with self._lock, torch.inference_mode():
            state = self.require_model().new_state(len(ids))
            return self.prefill(state, ids, chunk_sizes or [len(ids)], all_logits=True)

    def prompt_scores(
        self, token_ids: list[int], top: int, cancel: threading.Event | None = None
    ) -> PromptScores:
        """What each token after the first of ``token_ids`` scored at its position (the legacy ``echo`` logprobs):
        its log-probability and the ``top`` most likely tokens there.

        The prompt is prefilled in the engine's chunks (:func:`even_chunks`) on a state of its own, holding the
        engine's lock for one chunk at a time, so the step loop runs between chunks; of a chunk's logits only those
        numbers are kept, ``SCORE_ROWS`` rows' log-probabilities at a time. ``cancel`` set before a chunk raises a
        CANCELLED :class:`GenerateError`. ValueError for no tokens or a negative ``top``."""
        ids = [int(t) for t in token_ids]
        if not ids or top < 0:
            raise ValueError(
                f"token_ids, top: expected at least one token and top >= 0, got {len(ids)}, {top}"
            )
        with self._lock:
            state = self.require_model().new_state(len(ids))
        scores = PromptScores([], [], [])
        offset = 0
        for size in even_chunks(len(ids), self.chunk_size):
            with self._lock, torch.inference_mode():
                logits = self.prefill(
                    state, ids[offset : offset + size], [size], all_logits=True, cancel=cancel
                )
                following = torch.tensor(ids[offset + 1 : offset + size + 1], device=logits.device)
                for r in range(0, len(following), SCORE_ROWS):
                    lp = torch.log_softmax(logits[r : r + SCORE_ROWS].float(), dim=-1)[: len(following) - r]
                    scores.logprobs += lp.gather(1, following[r : r + SCORE_ROWS, None])[:, 0].tolist()
                    values, top_ids = lp.topk(top, dim=-1)
                    scores.top_ids += top_ids.tolist()
                    scores.top_logprobs += values.tolist()
            offset += size
        return scores

    # ---- generation ----------------------------------------------------------------------------
    def stream(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        speculative: object | None = None,
        snapshot: Snapshot | None = None,
        cache_at: tuple[int, ...] = (),
        priority: int = 0,
        on_token: Callable[[int], bool | None] | None = None,
        on_done: Callable[[GenerateResult], None] | None = None,
    ) -> RequestHandle:
        """Submit a generation to the step loop; iterate the handle for tokens as they are committed.

        ``snapshot`` (else one armed by :meth:`restore`, else the longest prefix in ``prefix_cache``) is
        restored when its tokens begin the prompt; ``cache_at``: prompt positions at which the prefill
        snapshots the state into ``prefix_cache``. ``priority``: lower is admitted first and may preempt a
        running request of a higher value (:mod:`.step_loop`). ``on_token`` and ``on_done`` as in
        :class:`RequestHandle`.
        """
        handle = RequestHandle(
            self,
            prompt_ids,
            params,
            speculative=speculative,
            snapshot=snapshot,
            cache_at=cache_at,
            priority=priority,
            on_token=on_token,
            on_done=on_done,
        )
        self.submit(handle)
        return handle

    def submit(self, handle: RequestHandle) -> None:
        """Queue a request built with this engine (see :meth:`stream`)."""
        self._loop.submit(handle)

    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        on_token: Callable[[int], bool | None] | None = None,
        speculative: object | None = None,
        snapshot: Snapshot | None = None,
    ) -> GenerateResult:
        """Generate until a stop token, ``max_tokens`` or cancellation (``on_token`` returning False)."""
        handle = self.stream(
            prompt_ids, params, speculative=speculative, snapshot=snapshot, on_token=on_token
        )
        for _ in handle:
            pass
        return handle.result

    def step(self) -> StepReport:
        """Run one step of the loop (admit, prefill, decode, retire) for every submitted request."""
        with self._lock, torch.inference_mode():
            return self._loop.step()

    def withdraw(self, handle: RequestHandle) -> bool:
        """Cancel ``handle``; True when it had not started (it has ended now), False when it stops at its next
        step."""
        return self._loop.withdraw(handle)

    def withdraw_waiting(self, reason: str) -> list[RequestHandle]:
        """Cancel and end every request not started yet; returns them."""
        return self._loop.withdraw_waiting(reason)

    @property
    def running(self) -> int:
        """Requests on the engine (admitted, not yet ended)."""
        return self._loop.running

    @property
    def waiting(self) -> int:
        """Requests submitted and not yet admitted."""
        return self._loop.waiting

    @property
    def idle(self) -> bool:
        return self._loop.idle

    @property
    def max_prefill_tokens(self) -> int:
        """Prompt tokens a step of the loop forwards (at least one chunk); settable between steps."""
        return self._loop.max_prefill_tokens

    @max_prefill_tokens.setter
    def max_prefill_tokens(self, tokens: int) -> None:
        self._loop.max_prefill_tokens = check_prefill_tokens(tokens)

    def warm_up(self, speculative: object | None = None) -> float:
        """Serve one short request and drop it, so that the first client does not wait for what the first
        request of a process pays once: on CUDA the compiles of the decode and prefill regions and the
        decode graph's capture, every first-chunk prefill graph's (:mod:`.prefill_graphs`), with
        ``speculative`` the draft's load and its graphs, and structured output's view of the vocabulary
        (:func:`.constraint.prepare`, when llguidance is installed). Leaves the engine as any finished request
        does (the next request starts from a reset state); returns the seconds it took. Raises RuntimeError
        when the request fails (a server should not start then)."""
        vocab = self.cfg.vocab_size
        prompt = [(i * 7919) % vocab for i in range(1, WARM_UP_PROMPT + 1)]
        start = time.perf_counter()
        res = self.generate(
            prompt, SamplingParams(max_tokens=WARM_UP_TOKENS, ignore_eos=True), speculative=speculative
        )
        if res.error is not None:
            raise RuntimeError(f"warm-up request failed: {res.error}: {res.error_message}")
        with self._lock, torch.inference_mode():
            graphs = self._prefill_graphs()
            if graphs is not None:
                graphs.capture_all()
            batch = self._batch_graphs()
            if batch is not None:
                batch.capture()
        prepare_constraints(self.tokenizer, vocab)
        return time.perf_counter() - start

    # ---- what the step loop asks of the engine -------------------------------------------------
    def validate(self, prompt: list[int], params: SamplingParams) -> list[int]:
        """The prompt as a list of ids; raises :class:`GenerateError` (invalid request, context overflow)."""
        if not isinstance(params, SamplingParams):
            raise GenerateError(ErrorCode.INVALID_REQUEST, "params: expected a SamplingParams")
        params.validate(self.cfg.vocab_size)
        if isinstance(prompt, (str, bytes)):
            raise GenerateError(
                ErrorCode.INVALID_REQUEST,
                "prompt: expected token ids, got text; encode it first (engine.tokenizer.encode)",
            )
        ids = list(prompt)
        if not ids:
            raise GenerateError(ErrorCode.INVALID_REQUEST, "prompt: expected at least one token")
        kinds = sorted({type(t).__name__ for t in ids if not isinstance(t, int) or isinstance(t, bool)})
        if kinds:
            raise GenerateError(
                ErrorCode.INVALID_REQUEST, f"prompt: expected a flat sequence of int token ids, got {kinds}"
            )
        bad = [t for t in ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise GenerateError(
                ErrorCode.INVALID_REQUEST,
                f"prompt: token ids outside the vocabulary [0, {self.cfg.vocab_size}): {bad[:5]}",
            )
        need = len(ids) + params.max_tokens
        if need > self.max_context:
            raise GenerateError(
                ErrorCode.CONTEXT_OVERFLOW,
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = {need} exceeds "
                f"the context of {self.max_context} tokens",
            )
        return ids

    def acquire_state(self, need: int) -> SequenceState:
        """A state for a request that needs ``need`` tokens (from the pool; it is the engine's current one).
        When a new one does not fit in memory, the pool's free states (and the graphs captured over them) go
        first and it is tried once more; ``torch.OutOfMemoryError`` if it still does not fit."""
        try:
            self._state = self._states.acquire(need)
        except torch.OutOfMemoryError:
            self._states.clear()
            _free_memory()
            self._state = self._states.acquire(need)
        return self._state

    def release_state(self, state: SequenceState) -> None:
        """A finished request's state, for the next ones (it stays readable by :meth:`snapshot` until reused)."""
        self._states.release(state)

    def drop_state(self, state: SequenceState) -> None:
        """A failed request's state: never reused."""
        self._states.drop(state)
        _free_memory()

    def take_pending_restore(self) -> Snapshot | None:
        """The snapshot armed by :meth:`restore`, once."""
        snap, self._pending_restore = self._pending_restore, None
        return snap

    def _forget_state(self, state: SequenceState) -> None:
        """``state`` leaves the pool: the graphs captured over it go with it."""
        if self._state is state:
            self._state = None
        if self._graph is not None and self._graph.state is state:
            self._graph = None
        self._drop_verify_graphs(lambda graph: graph.state is state)

    def proposer(self, speculative: object | None) -> object | None:
        """The draft proposer for ``speculative`` (None: plain decoding)."""
        if speculative is None:
            return None
        from .drafts import resolve_proposer

        return resolve_proposer(self, speculative)

    def decode_rows(self, states: list[SequenceState], tokens: list[int]) -> DecodedRows:
        """Forward ``tokens[i]`` on ``states[i]`` in one step, commit each, return each row's logits (and their
        argmax where a captured step took it): through the one-sequence step where the engine runs one sequence
        at a time, else the batched forward (captured over decode slots, :meth:`_batch_graphs`, or dynamic)."""
        if self.max_batch == 1:
            (state,), (token,) = states, tokens
            return self._decode_one(state, token)
        model = self.require_model()
        self.forward_calls += 1
        batch = self._batch_graphs()
        if batch is not None:
            pos = min(s.pos for s in states)
            with profiler.step("decode", len(tokens), pos, model.layers, graph=batch.graph):
                return batch.step(states, tokens)
        with profiler.step("decode", len(tokens), min(s.pos for s in states), model.layers):
            out = model.decode_batch(tokens, states)
        rows = []
        for i, state in enumerate(states):
            state.commit(out.deltas[i], 1)
            state.last_logits = out.logits[i]
            rows.append(state.last_logits)
        return DecodedRows(rows)

    def enter_slot(self, state: SequenceState) -> SequenceState:
        """Where ``state``'s sequence decodes: a decode slot now holding a copy of it, where the engine decodes
        batches through slots (:mod:`.batch_graphs`), else ``state`` itself. Give it to :meth:`decode_rows`."""
        batch = self._batch_graphs()
        if batch is None:
            return state
        slot = batch.slots.enter(state)
        if self._state is state:
            self._state = slot
        return slot

    def leave_slot(
        self, slot: SequenceState, state: SequenceState, keep: bool = True
    ) -> SequenceState | None:
        """The sequence decoding in ``slot`` (from :meth:`enter_slot` of ``state``) stops: with ``keep`` it is
        copied back into ``state``, and the slot is freed. Returns the slot whose sequence moved into ``slot``
        (its owner now decodes in ``slot``), or None."""
        if slot is state:
            return None
        if keep:
            state.restore(slot.snapshot())
        if self._state is slot:
            self._state = state
        moved = self._batch.slots.leave(slot)
        if moved is not None and self._state is moved:
            self._state = slot
        return moved

    def _batch_graphs(self) -> BatchGraphs | None:
        """The decode slots and captured batched steps of a whole model or a layer split on CUDA devices, made on
        first use: ``max_batch`` slots of ``max_context`` tokens. None where the engine runs one sequence at a
        time, has no graphs (CPU, ``eager``) or is a pipeline: batched steps then run the dynamic forward on the
        sequences' own states, which reads only their filled entries."""
        if self._batch is None:
            model = self.require_model()
            if self.max_batch == 1 or isinstance(model, PipelineModel) or self._graph_kinds(model) is None:
                return None
            _check_slots_fit(model, self.max_batch, self.max_context)
            slots = DecodeSlots(lambda: model.new_state(self.max_context), self.max_batch)
            self._batch = BatchGraphs(model, slots)
        return self._batch

    def decode_step(self, state: SequenceState, token: int) -> torch.Tensor:
        """Forward one token, commit it, return the logits after it."""
        return self._decode_one(state, token).logits[0]

    def _decode_one(self, state: SequenceState, token: int) -> DecodedRows:
        """:meth:`decode_step`'s logits, with their argmax where the decode graph took it."""
        model = self.require_model()
        graph = self._decode_graph(model, state)
        if graph is None:
            with profiler.step("decode", 1, state.pos, model.layers):
                result = self._forward([token], state, slice(0, 1))
            state.commit(result.delta, 1)
            state.last_logits = result.logits[0]
            return DecodedRows([state.last_logits])
        self.forward_calls += 1
        with profiler.step("decode", 1, state.pos, model.layers, graph=True):
            out = graph.step(token)
            state.last_logits = out.logits[0].clone()
        return DecodedRows([state.last_logits], out.choices)

    def _decode_graph(
        self, model: object, state: SequenceState
    ) -> DecodeGraph | SplitDecodeGraph | PipelineDecodeGraph | None:
        """The decode step captured for ``state`` (None: eager, or not on CUDA): one graph for a whole
        model, one per shard for a layer split in this process, one per rank for a pipeline."""
        kinds = self._graph_kinds(model)
        if kinds is None:
            return None
        if self._graph is None or self._graph.state is not state or self._graph.model is not model:
            self._graph = None
            self._graph = kinds[0](model, state)
        return self._graph

    def _graph_kinds(self, model: object) -> tuple[Callable, Callable] | None:
        """What builds the decode and the verify graphs of ``model``: a whole model, a layer split or a
        pipeline on CUDA devices, unless the engine is eager (None: every step runs eagerly)."""
        if self.eager:
            return None
        if self._graphs_apply(model):
            return DecodeGraph, self._whole_verify_graph
        if isinstance(model, SplitModel) and all(d.type == "cuda" for d in model.devices):
            return SplitDecodeGraph, SplitVerifyGraph
        if isinstance(model, PipelineModel) and model.device.type == "cuda":
            return PipelineModel.decode_graph, PipelineModel.verify_graph
        return None

    def _prefill_graphs(self) -> FirstChunkGraphs | PipelineFirstChunks | None:
        """The captured first prefill chunks of the model (:mod:`.prefill_graphs`; None: prefill eagerly)."""
        model = self.require_model()
        judged = self._first_chunks_apply
        if judged is None or judged[0] is not model or judged[1] != self.eager:
            if isinstance(model, PipelineModel):  # each rank judges its own experts (PipelineFirstChunks)
                apply = not self.eager and model.device.type == "cuda"
            else:
                split = not self.eager and isinstance(model, SplitModel)
                apply = (split or self._graphs_apply(model)) and prefill_graphs_apply(model)
            judged = self._first_chunks_apply = (model, self.eager, apply)
        if not judged[2]:
            return None
        limit = min(MAX_GRAPH_TOKENS, self.chunk_size)
        if (
            self._first_chunks is None
            or self._first_chunks.model is not model
            or self._first_chunks.limit != limit
        ):
            self._first_chunks = (
                model.first_chunks(limit)
                if isinstance(model, PipelineModel)
                else FirstChunkGraphs(model, limit)
            )
        return self._first_chunks

    def _default_max_batch(self, model: object, fraction: float) -> int:
        """The batch size an engine takes when none is given (see ``__init__``)."""
        if not isinstance(model, (DeepSeekV4, SplitModel)):  # a pipeline: batched eagerly, off CUDA only
            return 1 if self._graph_kinds(model) is not None else DEFAULT_MAX_BATCH
        memory = _slot_memory(model, self.max_context)
        if not memory:
            return DEFAULT_MAX_BATCH
        count = min(default_max_batch(per_slot, free, fraction) for _, per_slot, free in memory)
        log.info(
            "max_batch %d: decode slots of %d tokens take %s each, at most %.0f%% of the free memory",
            count,
            self.max_context,
            ", ".join(f"{per_slot / 2**30:.2f} GiB on {device}" for device, per_slot, _ in memory),
            fraction * 100,
        )
        return count

    def _graphs_apply(self, model: object) -> bool:
        """CUDA graphs are used for a whole model on CUDA unless the engine is eager (the draft models'
        graphs need the whole model in one place)."""
        return (
            not self.eager
            and isinstance(model, DeepSeekV4)
            and model.device.type == "cuda"
            and model.embed is not None
            and model.head is not None
        )

    def verify(
        self, state: SequenceState, block: list[int] | torch.Tensor, capture: tuple[int, ...] = ()
    ) -> "VerifyStep":
        """One target forward over ``block`` (host ids, or a tensor of them on the target's device, which the
        pipeline across processes does not take) at ``state.pos`` that writes nothing (a speculative verify
        step): every row's logits, the final streams and the ``capture`` layers' streams, through the verify
        graph of its width over ``state`` where the engine uses graphs. Read what is needed of the result and
        commit an accepted prefix with the step's :meth:`VerifyStep.commit` before the next verify, of any
        sequence: the graphs reuse their buffers and share their memory."""
        model = self.require_model()
        graph = self._verify_graph(model, state, len(block), capture)
        with profiler.step("verify", len(block), state.pos, model.layers, graph=graph is not None):
            if graph is None:
                out = model.forward(block, state, logit_rows=slice(None), capture=capture)
            else:
                out = graph.run(block)
        self.forward_calls += 1
        self.verifies += 1
        return VerifyStep(out, state, graph)

    def verify_block(
        self, state: SequenceState, width: int, capture: tuple[int, ...] = ()
    ) -> torch.Tensor | None:
        """The device buffer that the verify graph of ``width`` over ``state`` reads its block from, for a draft
        proposer to write the next block into and :meth:`verify` to be given as is (nothing is copied); None
        where verify steps run eagerly or over a split's or a pipeline's graphs."""
        graph = self._verify_graph(self.require_model(), state, width, capture)
        return (
            graph.tokens if isinstance(graph, cuda_graphs.VerifyGraph) else None
        )  # the module's: tests swap the name

    def _verify_graph(
        self, model: object, state: SequenceState, width: int, capture: tuple[int, ...]
    ) -> VerifyGraph | SplitVerifyGraph | PipelineVerifyGraph | None:
        """The captured verify block of ``width`` over ``state`` (None: verify eagerly). Graphs are kept for
        the ``max_batch`` states that verified last: those of the one used longest ago go first."""
        kinds = self._graph_kinds(model)
        if kinds is None:
            return None
        key = (id(state), width, tuple(capture))
        graph = self._verify_graphs.pop(key, None)
        if graph is not None and graph.model is not model:
            self._verify_graphs.clear()
            graph = None
        if graph is None:
            held = list(dict.fromkeys(k[0] for k in self._verify_graphs))
            if id(state) not in held and len(held) >= self.max_batch:
                self._drop_verify_graphs(lambda g: id(g.state) == held[0])
            graph = kinds[1](model, state, width, key[2])
        self._verify_graphs[key] = graph
        return graph

    def _whole_verify_graph(
        self, model: DeepSeekV4, state: SequenceState, width: int, capture: tuple[int, ...]
    ) -> VerifyGraph:
        """A whole model's verify graph, in the memory pool all of them share (they never run at once)."""
        if self._verify_pool is None and model.device.type == "cuda":
            self._verify_pool = torch.cuda.graph_pool_handle()
        return VerifyGraph(model, state, width, capture, pool=self._verify_pool)

    def _drop_verify_graphs(self, which: Callable[[object], bool]) -> None:
        for key in [k for k, graph in self._verify_graphs.items() if which(graph)]:
            del self._verify_graphs[key]

    # ---- snapshots -----------------------------------------------------------------------------
    def snapshot(self, device: str | torch.device | None = None) -> Snapshot:
        """Right-sized copy of the current sequence: the one admitted last (its tokens, state and last logits)."""
        with self._lock:
            if self._state is None or self._state.pos == 0:
                raise RuntimeError("snapshot: no sequence has been run yet")
            return self._state.snapshot(device)

    def restore(self, snapshot: Snapshot) -> None:
        """Arm ``snapshot`` for the next generation whose prompt starts with its tokens."""
        with self._lock:
            self._pending_restore = snapshot

    def new_sequence(self, capacity: int) -> SequenceState:
        return self.require_model().new_state(capacity)

    # ---- park / unpark -------------------------------------------------------------------------
    def park(self, what: str = "") -> list[str]:
        """Free the weights and states of ``what`` ('' / 'all', 'target', 'draft'); return what was parked.
        The requests running finish first (this call runs their steps; nothing new is admitted meanwhile)."""
        parts = _selected(what)
        with self._lock:
            self._drain()
            parked = []
            for part in parts:
                if part == "target" and self.model is not None:
                    self.model = None
                    self._states.clear()
                    self._graph = self._batch = None
                    self._first_chunks = self._first_chunks_apply = None
                    self._verify_graphs.clear()
                    if self.draft is not None:
                        self.draft.forget_passes()
                    self._state = None
                    self._pending_restore = None
                    parked.append("target")
                elif part == "draft" and self.draft is not None and self.draft.park():
                    parked.append("draft")
            _free_memory()
            return parked

    def unpark(self, what: str = "") -> list[str]:
        """Reload what :meth:`park` freed, from the same checkpoint and settings."""
        with self._lock:
            loaded = []
            for part in _selected(what):
                if part == "target" and self.model is None:
                    if self._loader is None:
                        raise RuntimeError("unpark: this engine has no loader to reload its weights from")
                    self.model = self._loader()
                    loaded.append("target")
                elif part == "draft" and self.draft is not None and self.draft.unpark():
                    loaded.append("draft")
            return loaded

    def _drain(self) -> None:
        """Run steps until no request is on the engine, admitting none meanwhile."""
        self._loop.hold_admission()
        try:
            while self._loop.running:
                self.step()
        finally:
            self._loop.release_admission()

    @property
    def parked(self) -> bool:
        return self.model is None

    @property
    def lock(self) -> threading.RLock:
        """The engine's reentrant lock: every step, score, snapshot, restore and park holds it. Hold it to run
        several engine calls (``new_sequence``, ``prefill``, a state's ``snapshot``) with no step in between."""
        return self._lock

    def require_model(self) -> DeepSeekV4:
        """The target model (a :class:`DeepSeekV4`, or a layer split or pipeline with its interface);
        raises :class:`GenerateError` ``MODEL_PARKED`` while it is parked."""
        if self.model is None:
            raise GenerateError(
                ErrorCode.MODEL_PARKED, "the model is parked; unpark it first (POST /admin/unpark)"
            )
        return self.model


SCORE_ROWS = 256  # prompt positions whose log-probabilities Engine.prompt_scores holds at once


@dataclasses.dataclass
class PromptScores:
    """:meth:`Engine.prompt_scores` of a prompt of S tokens: for each token after the first, its log-probability
    and the ``top`` most likely tokens at its position (ids and log-probabilities, best first)."""

    logprobs: list[float]  # [S - 1]
    top_ids: list[list[int]]  # [S - 1][top]
    top_logprobs: list[list[float]]  # [S - 1][top]


@dataclasses.dataclass
class VerifyStep:
    """A verify forward (:meth:`Engine.verify`): its result ``out`` and the commit of an accepted prefix."""

    out: ForwardResult
    state: SequenceState
    graph: VerifyGraph | SplitVerifyGraph | PipelineVerifyGraph | None

    def commit(self, tokens: list[int]) -> None:
        """Commit the block's first ``len(tokens)`` tokens (``tokens``: those ids) to the state."""
        if self.graph is None:
            self.state.commit(self.out.delta, len(tokens))
        else:
            self.graph.commit(tokens)


def default_max_batch(slot_bytes: int, free_bytes: int, fraction: float = SLOT_MEMORY_FRACTION) -> int:
    """Decode slots of ``slot_bytes`` each that ``fraction`` of ``free_bytes`` holds, at most
    :data:`DEFAULT_MAX_BATCH`; 1 (the one-sequence step, whose states grow with their requests) when fewer than
    two fit."""
    count = min(DEFAULT_MAX_BATCH, int(free_bytes * fraction) // max(1, slot_bytes))
    return count if count >= 2 else 1


def _slot_memory(model: DeepSeekV4 | SplitModel, max_context: int) -> list[tuple[torch.device, int, int]]:
    """Per CUDA device of ``model`` (each shard's of a layer split): the bytes of its layers' share of one
    decode slot of ``max_context`` tokens and the device's free bytes; empty off CUDA."""
    shards = model.shards if isinstance(model, SplitModel) else [model]
    need: dict[torch.device, int] = {}
    for s in shards:
        need[s.device] = need.get(s.device, 0) + state_nbytes(model.cfg, s.layers, max_context, s.dtype)
    return [(d, n, torch.cuda.mem_get_info(d)[0]) for d, n in need.items() if d.type == "cuda"]


def _check_slots_fit(model: DeepSeekV4 | SplitModel, count: int, max_context: int) -> None:
    """Raise a RuntimeError naming the options to change when ``count`` decode slots of ``max_context`` tokens
    would not fit in the free memory of one of the model's CUDA devices (nothing is checked elsewhere)."""
    for device, one, free in _slot_memory(model, max_context):
        if count * one > free:
            raise RuntimeError(
                f"decode slots: --max-batch {count} slots of --max-context {max_context} tokens need "
                f"{count * one / 2**30:.1f} GiB, {free / 2**30:.1f} GiB is free on {device}; "
                "lower --max-batch or --max-context"
            )


def default_chunk_size(on_cuda: bool) -> int:
    """The longest prefill chunk: 4096 tokens on CUDA (about the speed of 8192 at half the activations'
    memory; docs/ARCHITECTURE.md), 512 elsewhere."""
    return GPU_CHUNK_TOKENS if on_cuda else CPU_CHUNK_TOKENS


def _selected(what: str) -> tuple[str, ...]:
    if what not in PARK_SELECTORS:
        raise ValueError(f"selector: expected one of {list(PARK_SELECTORS)}, got {what!r}")
    return ("target", "draft") if what in ("", "all") else (what,)


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
