"""The engine: one model, one sequence at a time, exact chunked prefill and decode.

Every request starts from a clean :class:`~ds4serve.state.SequenceState` or from a restored
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
from typing import Callable, Iterator

import torch

from .. import profiler
from ..config import ModelConfig
from ..kernels import config as kernel_config
from ..kernels.config import KernelConfig
from ..model import DeepSeekV4, ForwardResult
from ..parallel.pipeline import PipelineDecodeGraph, PipelineFirstChunks, PipelineModel, PipelineVerifyGraph
from ..parallel.split_model import SplitModel
from ..state import SequenceState, Snapshot
from ..tokenizer import Tokenizer
from ..weights import Checkpoint
from .constraint import Constraint
from .constraint import for_request as constraint_for
from .constraint import prepare as prepare_constraints
from .cuda_graphs import DecodeGraph, SplitDecodeGraph, SplitVerifyGraph, VerifyGraph
from .generation import Generation
from .prefill_graphs import MAX_GRAPH_TOKENS, FirstChunkGraphs
from .prefill_graphs import graphs_apply as prefill_graphs_apply
from .request import ErrorCode, GenerateError, GenerateResult, SamplingParams
from .speculative import PromptFeed, speculative_decode

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
MIN_STATE_TOKENS = 1024  # the smallest sequence state the engine allocates (see state_capacity)
GPU_CHUNK_TOKENS, CPU_CHUNK_TOKENS = 4096, 512  # default longest prefill chunk (see default_chunk_size)


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


class RequestHandle:
    """A running generation: iterate it for tokens, ``cancel()`` it, read ``result`` when done."""

    def __init__(
        self,
        engine: "Engine",
        prompt: list[int],
        params: SamplingParams,
        speculative: object | None,
        snapshot: Snapshot | None,
    ):
        self.prompt = list(prompt) if not isinstance(prompt, list) else prompt
        self.params = params
        self.result = GenerateResult()
        self._cancel = threading.Event()
        self._tokens = engine._run(self, speculative, snapshot)

    def cancel(self) -> None:
        """Stop before the next forward; the result ends with ``finish_reason='cancelled'``."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def __iter__(self) -> Iterator[int]:
        return self._tokens


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
    ):
        if chunk_size < 1:
            raise ValueError(f"chunk_size: expected an integer >= 1, got {chunk_size}")
        self.model: DeepSeekV4 | None = model
        self.cfg: ModelConfig = model.cfg
        self.tokenizer = tokenizer
        self.path = path
        self._loader = loader
        self.device = model.device
        self.dtype = model.dtype
        self.max_context = max_context or self.cfg.max_position_embeddings
        self.chunk_size = chunk_size
        self.draft = None  # a draft model with park()/unpark(), set by speculative decoding
        self._state: SequenceState | None = None
        self._pending_restore: Snapshot | None = None
        self._lock = threading.RLock()
        self.forward_calls = 0
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
        # (width, capture) -> the verify graph over self._state
        self._verify_graphs: dict[
            tuple[int, tuple[int, ...]], VerifyGraph | SplitVerifyGraph | PipelineVerifyGraph
        ] = {}

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
    ) -> "Engine":
        """Load a checkpoint on ``device``, or split its layers over ``devices`` (see docs/PARALLEL.md).

        ``quantized`` keeps FP8 / MXFP4 tensors quantized in memory, read in place by the GPU kernels
        (default: on CUDA devices; elsewhere they are dequantised once at load, exactly);
        ``chunk_size`` is the longest prefill chunk (default :func:`default_chunk_size`);
        ``eager`` runs every step without CUDA graphs; ``kernels``, when given, is installed as the
        process's kernel configuration (Triton kernels or the torch reference, PDL).
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
    ) -> torch.Tensor | None:
        """Forward ``ids`` chunk by chunk, committing each chunk.

        Returns the last position's logits ``[V]`` (or every position's ``[N, V]`` with
        ``all_logits``). Intermediate chunks skip the output head. ``on_chunk`` receives each
        committed chunk's forward result (with the layers it asks to capture). ``cancel`` set
        before a chunk raises a CANCELLED :class:`GenerateError` (the state keeps the chunks done).
        """
        capture = () if on_chunk is None else on_chunk.capture_layers
        sizes = chunk_sizes or _even_chunks(len(ids), self.chunk_size)
        graphs = None if all_logits or on_chunk is not None else self._prefill_graphs()
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
            else:
                with profiler.step("prefill", size, state.pos, self.require_model().layers):
                    result = self._forward(chunk, state, rows, capture)
            state.commit(result.delta, size)
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

    # ---- generation ----------------------------------------------------------------------------
    def stream(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        speculative: object | None = None,
        snapshot: Snapshot | None = None,
    ) -> RequestHandle:
        """Start a generation; iterate the handle for tokens as they are committed."""
        return RequestHandle(self, prompt_ids, params, speculative, snapshot)

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
        handle = self.stream(prompt_ids, params, speculative=speculative, snapshot=snapshot)
        for token in handle:
            if on_token is not None and on_token(token) is False:
                handle.cancel()
        return handle.result

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
        prepare_constraints(self.tokenizer, vocab)
        return time.perf_counter() - start

    def _run(
        self, handle: RequestHandle, speculative: object | None, snapshot: Snapshot | None
    ) -> Iterator[int]:
        res, params = handle.result, handle.params
        start = time.perf_counter()
        with self._lock, torch.inference_mode():
            calls = self.forward_calls
            try:
                with profiler.request(res):
                    self.require_model()
                    prompt = self._validate(handle.prompt, params)
                    # compiled before the prompt is prefilled (a bad schema costs no forward)
                    constraint = constraint_for(params, self.tokenizer, self.cfg.vocab_size)
                    proposer = self._proposer(speculative)
                    feed = None if proposer is None else PromptFeed(proposer)
                    state, logits = self._start(
                        prompt,
                        params.max_tokens,
                        snapshot or self._pending_restore,
                        res,
                        feed,
                        handle._cancel,
                    )
                    self._pending_restore = None
                    if (
                        logits.is_cuda
                    ):  # the forward returns before the device has run it: the first token waits
                        torch.cuda.current_stream(
                            logits.device
                        ).synchronize()  # for it anyway, so time it here
                    res.timings.prefill_s = time.perf_counter() - start
                    if feed is None:
                        yield from self._decode_loop(handle, state, logits, start, constraint)
                    else:
                        yield from speculative_decode(self, handle, state, logits, start, feed, constraint)
            except GenerateError as exc:
                res.error, res.error_message = exc.code, exc.message
                res.finish_reason = "cancelled" if exc.code is ErrorCode.CANCELLED else "error"
            except torch.OutOfMemoryError as exc:
                res.error, res.error_message, res.finish_reason = ErrorCode.OUT_OF_MEMORY, str(exc), "error"
                self._state = None
                _free_memory()
            except Exception as exc:  # noqa: BLE001 - every failure becomes a structured result
                log.exception("generation failed")
                res.error, res.finish_reason = ErrorCode.INTERNAL, "error"
                res.error_message = f"{type(exc).__name__}: {exc}"
                self._state = None
            res.stats.forward_calls = self.forward_calls - calls

    def _validate(self, prompt: list[int], params: SamplingParams) -> list[int]:
        if not isinstance(params, SamplingParams):
            raise GenerateError(ErrorCode.INVALID_REQUEST, "params: expected a SamplingParams")
        params.validate(self.cfg.vocab_size)
        ids = list(prompt)
        if not ids:
            raise GenerateError(ErrorCode.INVALID_REQUEST, "prompt: expected at least one token")
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.cfg.vocab_size]
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

    def _start(
        self,
        prompt: list[int],
        max_tokens: int,
        snapshot: Snapshot | None,
        res: GenerateResult,
        feed: "PromptFeed | None" = None,
        cancel: threading.Event | None = None,
    ) -> tuple[SequenceState, torch.Tensor]:
        """A clean or restored state with the prompt prefilled, and the logits after its last token.

        With a speculative ``feed``, the draft proposer starts from the restored tokens and sees
        every prefilled chunk (its target features captured in the same forward).
        """
        res.stats.prompt_tokens = len(prompt)
        state = self._acquire_state(len(prompt) + max_tokens)
        reuse = 0
        if snapshot is not None and _usable(snapshot, prompt):
            state.restore(snapshot)
            reuse = snapshot.pos
        else:
            state.reset()
        res.stats.cached_tokens = reuse
        res.stats.prefilled_tokens = len(prompt) - reuse
        if feed is not None:
            feed.proposer.begin(prompt[:reuse], state.max_context)
        if reuse == len(prompt):
            return state, state.last_logits
        return state, self.prefill(state, prompt[reuse:], on_chunk=feed, cancel=cancel)

    def _acquire_state(self, need: int) -> SequenceState:
        if self._state is None or self._state.max_context < need:
            self._state, self._graph = None, None  # free the old state and the graphs over it first
            self._verify_graphs.clear()
            self._state = self.require_model().new_state(state_capacity(need, self.max_context))
        return self._state

    def _decode_loop(
        self,
        handle: RequestHandle,
        state: SequenceState,
        logits: torch.Tensor,
        start: float,
        constraint: Constraint | None,
    ) -> Iterator[int]:
        gen = Generation(
            handle.prompt,
            handle.params,
            handle.result,
            self.cfg,
            self.tokenizer,
            self.device,  # where the logits land; a snapshot's host copy of them is moved there to sample
            start,
            constraint,
        )
        decode_start = time.perf_counter()
        while True:
            if handle.cancelled:
                gen.cancel()
                break
            token = gen.choose(logits)
            done = gen.accept(token, logits)
            yield token
            if done:
                break
            if not handle.cancelled:
                logits = self.decode_step(state, token)
        handle.result.timings.decode_s = time.perf_counter() - decode_start

    def _proposer(self, speculative: object | None) -> object | None:
        """The draft proposer for ``speculative`` (None: plain decoding)."""
        if speculative is None:
            return None
        from .drafts import resolve_proposer

        return resolve_proposer(self, speculative)

    def decode_step(self, state: SequenceState, token: int) -> torch.Tensor:
        """Forward one token, commit it, return the logits after it."""
        model = self.require_model()
        graph = self._decode_graph(model, state)
        if graph is None:
            with profiler.step("decode", 1, state.pos, model.layers):
                result = self._forward([token], state, slice(0, 1))
            state.commit(result.delta, 1)
            state.last_logits = result.logits[0]
        else:
            self.forward_calls += 1
            with profiler.step("decode", 1, state.pos, model.layers, graph=True):
                state.last_logits = graph.step(token)[0].clone()
        return state.last_logits

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
            return DecodeGraph, VerifyGraph
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

    def verify(self, state: SequenceState, block: list[int], capture: tuple[int, ...] = ()) -> "VerifyStep":
        """One target forward over ``block`` at ``state.pos`` that writes nothing (a speculative verify
        step): every row's logits, the final streams and the ``capture`` layers' streams, through the verify
        graph of its width where the engine uses graphs. Commit an accepted prefix with the step's
        :meth:`VerifyStep.commit` before the next forward over ``state``: a graph reuses its buffers."""
        model = self.require_model()
        graph = self._verify_graph(model, state, len(block), capture)
        with profiler.step("verify", len(block), state.pos, model.layers, graph=graph is not None):
            if graph is None:
                out = model.forward(block, state, logit_rows=slice(None), capture=capture)
            else:
                out = graph.run(block)
        self.forward_calls += 1
        return VerifyStep(out, state, graph)

    def _verify_graph(
        self, model: object, state: SequenceState, width: int, capture: tuple[int, ...]
    ) -> VerifyGraph | SplitVerifyGraph | PipelineVerifyGraph | None:
        """The captured verify block of ``width`` over ``state`` (None: verify eagerly)."""
        kinds = self._graph_kinds(model)
        if kinds is None:
            return None
        key = (width, tuple(capture))
        graph = self._verify_graphs.get(key)
        if graph is not None and (graph.state is not state or graph.model is not model):
            self._verify_graphs.clear()
            graph = None
        if graph is None:
            graph = self._verify_graphs[key] = kinds[1](model, state, width, key[1])
        return graph

    # ---- snapshots -----------------------------------------------------------------------------
    def snapshot(self, device: str | torch.device | None = None) -> Snapshot:
        """Right-sized copy of the current sequence (its tokens, state and last logits)."""
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
        """Free the weights and states of ``what`` ('' / 'all', 'target', 'draft'); return what was parked."""
        with self._lock:
            parked = []
            for part in _selected(what):
                if part == "target" and self.model is not None:
                    self.model = None
                    self._graph = None
                    self._first_chunks = self._first_chunks_apply = None
                    self._verify_graphs.clear()
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

    @property
    def parked(self) -> bool:
        return self.model is None

    @property
    def lock(self) -> threading.RLock:
        """The engine's reentrant lock: every generation, score, snapshot, restore and park holds it. Hold it
        to run several engine calls (``new_sequence``, ``prefill``, a state's ``snapshot``) with no request
        in between."""
        return self._lock

    def require_model(self) -> DeepSeekV4:
        """The target model (a :class:`DeepSeekV4`, or a layer split or pipeline with its interface);
        raises :class:`GenerateError` ``MODEL_PARKED`` while it is parked."""
        if self.model is None:
            raise GenerateError(
                ErrorCode.MODEL_PARKED, "the model is parked; unpark it first (POST /admin/unpark)"
            )
        return self.model


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


def default_chunk_size(on_cuda: bool) -> int:
    """The longest prefill chunk: 4096 tokens on CUDA (about the speed of 8192 at half the activations'
    memory; docs/ARCHITECTURE.md), 512 elsewhere."""
    return GPU_CHUNK_TOKENS if on_cuda else CPU_CHUNK_TOKENS


def state_capacity(need: int, max_context: int, floor: int = MIN_STATE_TOKENS) -> int:
    """The tokens a new sequence state holds for a request that needs ``need``: the next power of two
    (at least ``floor``), capped at ``max_context``. The state is kept while requests fit, and each new
    capacity means a new decode graph and, for the compiled regions, a new compile; powers of two
    bound both to a few per engine instead of one per larger request."""
    return min(max_context, max(floor, 1 << max(need - 1, 0).bit_length()))


def _selected(what: str) -> tuple[str, ...]:
    if what not in PARK_SELECTORS:
        raise ValueError(f"selector: expected one of {list(PARK_SELECTORS)}, got {what!r}")
    return ("target", "draft") if what in ("", "all") else (what,)


def _usable(snapshot: Snapshot, prompt: list[int]) -> bool:
    if snapshot.pos > len(prompt) or prompt[: snapshot.pos] != snapshot.tokens:
        return False
    return snapshot.pos < len(prompt) or snapshot.last_logits is not None


def _even_chunks(n: int, size: int) -> list[int]:
    return [min(size, n - i) for i in range(0, n, size)]


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
