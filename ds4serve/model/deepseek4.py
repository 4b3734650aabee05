"""The DeepSeek-V4 transformer over a range of layers: one forward for every mode.

:meth:`DeepSeekV4.forward` runs a chunk of new tokens (a prefill chunk, one decode token, or a
speculative verify block) over the committed :class:`~ds4serve.state.SequenceState` and writes
nothing: it returns the chunk's :class:`~ds4serve.state.ChunkDelta`, which the caller commits in
full or in part. The embedding runs only when the range starts at layer 0 and the head only when
it ends at the last layer, so a layer split reuses this class shard by shard.
"""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch

from .. import profiler
from ..config import CSA, SLIDING, ModelConfig
from ..kernels import regions
from ..kernels.regions import region
from ..quant import FP4Weight, FP8Weight, Weight, fp4_from_checkpoint, fp8_from_checkpoint
from ..state import ChunkDelta, LayerDelta, LayerState, SequenceState
from ..weights import Checkpoint
from .attention import AttentionWeights, ChunkInfo, IndexerWeights, attention, concatenate_projections
from .compressor import CompressorWeights
from .hyper import HCSite, fused_sites, hc_head, hc_merge, hc_merge_pre, hc_pre
from .linear import linear
from .moe import MoEWeights, moe
from .norms import rms_norm
from .rope import Rope

if TYPE_CHECKING:
    from .batch import BatchForward


@dataclass
class BlockWeights:
    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    hc_attn: HCSite
    hc_ffn: HCSite
    attn: AttentionWeights
    moe: MoEWeights


@dataclass
class HeadWeights:
    hc_fn: torch.Tensor
    hc_base: torch.Tensor
    hc_scale: torch.Tensor
    norm: torch.Tensor
    head: torch.Tensor  # [V', D]: the rows of head.weight that are not all zero (see vocab_rows)
    ids: torch.Tensor | None = None  # [V'] long: their token ids, ascending; None: every row (V' = V)


@dataclass
class ForwardResult:
    hidden: torch.Tensor  # [S, hc, D] streams after the range's last layer (before hc_head)
    delta: ChunkDelta
    logits: torch.Tensor | None = None  # [rows, V] float32, when asked for and this range has the head
    captured: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> streams after it
    choices: torch.Tensor | None = (
        None  # [rows] long: each logits row's argmax, where a captured step took it
    )


class DeepSeekV4:
    """Weights of a contiguous layer range and the forward over it."""

    def __init__(
        self,
        cfg: ModelConfig,
        layers: range,
        blocks: dict[int, BlockWeights],
        embed: torch.Tensor | None,
        head: HeadWeights | None,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.cfg = cfg
        self.layers = layers
        self.blocks = blocks
        self.embed = embed
        self.head = head
        self.dtype = dtype
        self.device = device
        self.ropes = {
            "main": Rope(cfg.rope_main, cfg.rope_dim, device),
            "compress": Rope(cfg.rope_compress, cfg.rope_dim, device),
        }

    @classmethod
    def load(
        cls,
        ckpt: Checkpoint,
        layers: range | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        quantized: bool = False,
    ) -> "DeepSeekV4":
        """Load a layer range; ``quantized`` keeps FP8 / MXFP4 tensors quantized in memory."""
        cfg = ckpt.cfg
        layers = layers if layers is not None else range(cfg.num_layers)
        if not (0 <= layers.start < layers.stop <= cfg.num_layers):
            raise ValueError(f"layer range {layers.start}..{layers.stop} outside 0..{cfg.num_layers}")
        device = torch.device(device)
        blocks = {
            i: load_block(
                ckpt, f"layers.{i}", cfg.layer_types[i], cfg.is_hash_layer(i), dtype, device, quantized
            )
            for i in layers
        }
        embed = ckpt.dense("embed.weight", dtype, device) if layers.start == 0 else None
        head = None
        if layers.stop == cfg.num_layers:
            head = load_head(ckpt, "", dtype, device)
        return cls(cfg, layers, blocks, embed, head, dtype, device)

    # ---- state ---------------------------------------------------------------------------------
    def new_state(self, max_context: int) -> SequenceState:
        return SequenceState.allocate(self.cfg, self.layers, max_context, self.dtype, self.device)

    # ---- forward -------------------------------------------------------------------------------
    def chunk_info(self, start: int, length: int, positions: torch.Tensor | None = None) -> ChunkInfo:
        static = positions is not None
        if positions is None:
            positions = torch.arange(start, start + length, device=self.device)
        rope = {name: r.cos_sin(positions, self.dtype) for name, r in self.ropes.items()}
        return ChunkInfo(start=start, positions=positions, rope=rope, static=static)

    def forward(
        self,
        token_ids: list[int] | torch.Tensor,
        state: SequenceState,
        *,
        hidden: torch.Tensor | None = None,
        logit_rows: torch.Tensor | slice | None = None,
        capture: tuple[int, ...] = (),
        positions: torch.Tensor | None = None,
    ) -> ForwardResult:
        """Run the chunk ``token_ids`` at positions ``state.pos ..`` over this layer range.

        ``hidden`` is the incoming stream state ``[S, hc, D]`` when this range does not start at
        layer 0. ``logit_rows`` selects the chunk rows whose logits are computed (None: no head).
        ``positions`` (a device tensor holding ``state.pos ..``, one per token) makes the step
        static: no shape or value taken from the host position, nothing synchronising with the host,
        so it can be captured as a CUDA graph (:mod:`ds4serve.engine.cuda_graphs`). The delta's
        ``tokens`` are then left empty when ``token_ids`` is a tensor, as they are while a CUDA graph is
        captured; the caller knows them. A static
        block of several tokens (a verify step) is committed by :meth:`SequenceState.commit_static`.
        """
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device).view(-1)
        S = ids.shape[0]
        if S == 0:
            raise ValueError("empty chunk")
        if state.pos + S > state.max_context:
            raise ValueError(f"chunk of {S} at position {state.pos} exceeds the state's {state.max_context}")
        if self.embed is not None:
            X = self.streams(ids)
        elif hidden is None:
            raise ValueError(f"layer range {self.layers.start}.. needs the incoming hidden streams")
        else:
            X = hidden.to(device=self.device, dtype=self.dtype)
        if positions is not None and positions.shape != (S,):
            raise ValueError(
                f"a static step needs one position per token, got {tuple(positions.shape)} for {S}"
            )
        deltas: dict[int, LayerDelta] = {}
        captured: dict[int, torch.Tensor] = {}
        with regions.static_step() if positions is not None else nullcontext():
            chunk = self.chunk_info(state.pos, S, positions)
            pending = None
            for i in self.layers:
                # a block's closing merge joins the next block's first mHC site when that is one launch
                defer = i != self.layers[-1] and i not in capture and fused_sites(X)
                X, deltas[i], pending = block_forward(
                    self.blocks[i], X, chunk, state.layers[i], ids, self.cfg, self.ropes, pending, defer
                )
                if i in capture:
                    captured[i] = X
            logits = None
            if logit_rows is not None and self.head is not None:
                logits = self.logits(X[logit_rows])
        if isinstance(token_ids, torch.Tensor):  # not read back during a capture (it would synchronise)
            capturing = ids.is_cuda and torch.cuda.is_current_stream_capturing()
            tokens = [] if positions is not None or capturing else ids.tolist()
        else:
            tokens = [int(t) for t in token_ids]
        delta = ChunkDelta(start=state.pos, tokens=tokens, layers=deltas)
        return ForwardResult(hidden=X, delta=delta, logits=logits, captured=captured)

    def streams(self, ids: torch.Tensor) -> torch.Tensor:
        """The embedding of ``ids [S]`` as the ``hc`` identical residual streams ``[S, hc, D]``."""
        return self.embed[ids].unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()

    def decode_batch(
        self,
        token_ids: Sequence[int] | torch.Tensor,
        states: Sequence[SequenceState],
        *,
        hidden: torch.Tensor | None = None,
        positions: Sequence[torch.Tensor] | None = None,
    ) -> BatchForward:
        """One new token for each of N sequences, each row bitwise independent of the others
        (:func:`ds4serve.model.batch.decode_batch`; ``positions``: a static step); writes nothing."""
        from .batch import decode_batch

        return decode_batch(self, token_ids, states, hidden=hidden, positions=positions)

    def logits(self, X: torch.Tensor) -> torch.Tensor:
        """Final merge, norm and head for streams ``X [N, hc, D]``: float32 ``[N, V]``."""
        return head_logits(self.head, X, self.cfg)

    # ---- bookkeeping ---------------------------------------------------------------------------
    def tensors(self) -> list[torch.Tensor]:
        out: list[torch.Tensor] = [] if self.embed is None else [self.embed]
        for b in self.blocks.values():
            out.extend(_tensors_of(b))
        if self.head is not None:
            out.extend(_tensors_of(self.head))
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


# a sublayer's (out, post, comb), not yet merged; out may be the MoE's fp32 slot terms [S, slots, D]
PendingMerge = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def block_forward(
    b: BlockWeights,
    X: torch.Tensor,
    chunk: ChunkInfo,
    ls: LayerState,
    ids: torch.Tensor,
    cfg: ModelConfig,
    ropes: dict[str, Rope],
    pending: PendingMerge | None = None,
    defer: bool = False,
) -> tuple[torch.Tensor, LayerDelta, PendingMerge | None]:
    """One decoder block: hc_pre, attention, hc_post with the next hc_pre (one call), MoE, hc_post;
    returns ``(X, delta, None)``.

    ``pending`` (the previous block's MoE output with its ``post`` and ``comb``) is merged into ``X`` by the
    block's first mHC site, in the same call (:func:`~ds4serve.model.hyper.hc_merge_pre`); ``defer`` leaves
    this block's own closing merge to the next block that way: it then returns ``(X before that merge,
    delta, its pending merge)``. With the fused sites every mHC boundary of a decode step is then one launch;
    the results are those of merging first.

    A static step runs the block as one compiled region. Its chunk
    start is then given as 0: the compiled code must not depend on the host position (a new
    position would recompile), and the only use of it, the delta's ``first_entry``, is set per step
    by :func:`ds4serve.engine.cuda_graphs.delta_at` anyway.
    """
    if chunk.static:
        return _static_block(b, X, dataclasses.replace(chunk, start=0), ls, ids, cfg, ropes, pending, defer)
    return _block(b, X, chunk, ls, ids, cfg, ropes, pending, defer)


@region
def _static_block(
    b: BlockWeights,
    X: torch.Tensor,
    chunk: ChunkInfo,
    ls: LayerState,
    ids: torch.Tensor,
    cfg: ModelConfig,
    ropes: dict[str, Rope],
    pending: PendingMerge | None,
    defer: bool,
) -> tuple[torch.Tensor, LayerDelta, PendingMerge | None]:
    """:func:`_block` as one compiled region (see :func:`block_forward`)."""
    return _block(b, X, chunk, ls, ids, cfg, ropes, pending, defer)


def _block(
    b: BlockWeights,
    X: torch.Tensor,
    chunk: ChunkInfo,
    ls: LayerState,
    ids: torch.Tensor,
    cfg: ModelConfig,
    ropes: dict[str, Rope],
    pending: PendingMerge | None,
    defer: bool,
) -> tuple[torch.Tensor, LayerDelta, PendingMerge | None]:
    X, post, comb, x = attention_site(b, X, pending, cfg)
    with profiler.phase("attention"):
        a, delta = attention(b.attn, x, chunk, ls, cfg, ropes)
    X, post, comb, x = ffn_site(b, X, a, post, comb, cfg)
    with profiler.phase("moe_ffn"):
        # a deferred merge sums the MoE's slot terms itself: one launch less
        m = moe(b.moe, x, ids, cfg.top_k, cfg.routed_scaling_factor, cfg.swiglu_limit, slot_terms=defer)
    X, pending = block_end(X, m, post, comb, defer)
    return X, delta, pending


def attention_site(
    b: BlockWeights, X: torch.Tensor, pending: PendingMerge | None, cfg: ModelConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A block's first mHC site, after the previous block's ``pending`` merge if any: ``(X, post, comb, x)``,
    ``x`` the attention's normalised input.

    "hc_pre" includes the sublayer's input norm, fused or not, so that the phases measure the same work
    either way."""
    hc, iters, eps, neps = cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps
    with profiler.phase("hc_pre"):
        if pending is None:
            return X, *hc_pre(X, b.hc_attn, b.attn_norm, hc, iters, eps, neps)
        return hc_merge_pre(X, *pending, b.hc_attn, b.attn_norm, hc, iters, eps, neps)


def ffn_site(
    b: BlockWeights,
    X: torch.Tensor,
    a: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    cfg: ModelConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The attention output ``a``'s merge and the MoE's pre site, one call (one launch when fused):
    ``(X, post, comb, x)``. Both are timed as "hc_pre", fused or not; "hc_post" is the block-end merge alone."""
    hc, iters, eps, neps = cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps
    with profiler.phase("hc_pre"):
        return hc_merge_pre(X, a, post, comb, b.hc_ffn, b.ffn_norm, hc, iters, eps, neps)


def block_end(
    X: torch.Tensor, m: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, defer: bool
) -> tuple[torch.Tensor, PendingMerge | None]:
    """The MoE output ``m``'s merge: ``(X', None)``, or with ``defer`` ``(X, (m, post, comb))`` left to the
    next block's first site (:func:`attention_site`)."""
    if defer:
        return X, (m, post, comb)
    with profiler.phase("hc_post"):
        return hc_merge(X, m, post, comb), None


def head_logits(h: HeadWeights, X: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    with profiler.phase("output_projection"):
        merged = hc_head(X, h.hc_fn, h.hc_base, h.hc_scale, cfg.hc_eps, cfg.rms_norm_eps)
        return vocab_logits(rms_norm(merged, h.norm, cfg.rms_norm_eps), h, cfg)


def vocab_logits(x: torch.Tensor, h: HeadWeights, cfg: ModelConfig) -> torch.Tensor:
    """float32 logits ``[N, V]`` of normed rows ``x [N, D]`` through the head's rows; a token without one
    (``h.ids``) gets 0, what its all-zero row gives."""
    logits = linear(x, h.head).float()
    if h.ids is None:
        return logits
    return logits.new_zeros(x.shape[0], cfg.vocab_size).index_copy_(1, h.ids, logits)


def vocab_rows(head: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``head [V, D]`` without its all-zero rows, and the token ids of the rows kept (None: no row is all
    zero, ``head`` itself). A zero row's logit is 0 whatever the input, so the head need not compute it: a
    checkpoint trained on part of the vocabulary (the built-in model keeps 16,515 of 129,280 rows) leaves
    the others zero. A row holding NaN or infinity is kept."""
    kept = torch.cat([(part != 0).any(dim=1) for part in head.split(8192)])  # no [V, D] temporary
    if bool(kept.all()):
        return head, None
    ids = kept.nonzero().flatten()
    return head[ids].contiguous(), ids


# ---- loading ------------------------------------------------------------------------------------
def load_block(
    ckpt: Checkpoint,
    prefix: str,
    layer_type: str,
    hash_moe: bool,
    dtype: torch.dtype,
    device: torch.device,
    quantized: bool = False,
) -> BlockWeights:
    """Load one block (``layers.L`` or an MTP block such as ``mtp.0``).

    With ``quantized``, projections and experts stored as FP8 / MXFP4 stay quantized.
    """
    cfg = ckpt.cfg

    def t(name: str) -> Weight:
        if quantized:
            q = _quantized(ckpt, f"{prefix}.{name}", device)
            if q is not None:
                return q
        return ckpt.dense(f"{prefix}.{name}", dtype, device)

    def experts(which: str) -> Weight:
        names = [f"{prefix}.ffn.experts.{e}.{which}.weight" for e in range(cfg.n_routed_experts)]
        parts = [_quantized(ckpt, n, device) for n in names] if quantized else [None]
        if any(p is None for p in parts):
            return ckpt.experts(prefix, which, dtype, device)
        data, scale = torch.stack([p.data for p in parts]), torch.stack([p.scale for p in parts])
        return (
            FP8Weight(data, scale, parts[0].block)
            if isinstance(parts[0], FP8Weight)
            else FP4Weight(data, scale)
        )

    def f32(name: str) -> torch.Tensor:
        return ckpt.dense(f"{prefix}.{name}", torch.float32, device)

    def compressor(base: str) -> CompressorWeights:
        return CompressorWeights(
            wkv=t(f"{base}.wkv.weight"),
            wgate=t(f"{base}.wgate.weight"),
            ape=f32(f"{base}.ape"),
            norm=f32(f"{base}.norm.weight"),
        )

    attn = AttentionWeights(
        layer_type=layer_type,
        wq_a=t("attn.wq_a.weight"),
        q_norm=f32("attn.q_norm.weight"),
        wq_b=t("attn.wq_b.weight"),
        wkv=t("attn.wkv.weight"),
        kv_norm=f32("attn.kv_norm.weight"),
        wo_a=t("attn.wo_a.weight"),
        wo_b=t("attn.wo_b.weight"),
        sinks=f32("attn.attn_sink"),
    )
    if layer_type != SLIDING:
        attn.compressor = compressor("attn.compressor")
    if layer_type == CSA:
        attn.indexer = IndexerWeights(
            wq_b=t("attn.indexer.wq_b.weight"),
            weights_proj=t("attn.indexer.weights_proj.weight"),
            compressor=compressor("attn.indexer.compressor"),
        )
    concatenate_projections(attn)
    moe_w = MoEWeights(
        gate=t("ffn.gate.weight"),
        bias=None if hash_moe else f32("ffn.gate.bias"),
        tid2eid=ckpt.dense(f"{prefix}.ffn.gate.tid2eid", device=device) if hash_moe else None,
        w1=experts("w1"),
        w3=experts("w3"),
        w2=experts("w2"),
        shared_w1=t("ffn.shared_experts.w1.weight"),
        shared_w3=t("ffn.shared_experts.w3.weight"),
        shared_w2=t("ffn.shared_experts.w2.weight"),
    )
    return BlockWeights(
        attn_norm=f32("attn_norm.weight"),
        ffn_norm=f32("ffn_norm.weight"),
        hc_attn=HCSite(f32("hc_attn_fn"), f32("hc_attn_base"), f32("hc_attn_scale")),
        hc_ffn=HCSite(f32("hc_ffn_fn"), f32("hc_ffn_base"), f32("hc_ffn_scale")),
        attn=attn,
        moe=moe_w,
    )


def load_head(ckpt: Checkpoint, prefix: str, dtype: torch.dtype, device: torch.device) -> HeadWeights:
    """The final merge + norm (``prefix`` '' for the model, 'mtp.0.' for an MTP block) and the shared head."""
    head, ids = vocab_rows(ckpt.dense("head.weight", dtype, device))
    return HeadWeights(
        hc_fn=ckpt.dense(f"{prefix}hc_head_fn", torch.float32, device),
        hc_base=ckpt.dense(f"{prefix}hc_head_base", torch.float32, device),
        hc_scale=ckpt.dense(f"{prefix}hc_head_scale", torch.float32, device),
        norm=ckpt.dense(f"{prefix}norm.weight", torch.float32, device),
        head=head,
        ids=ids,
    )


def _quantized(ckpt: Checkpoint, name: str, device: torch.device) -> FP8Weight | FP4Weight | None:
    stored = ckpt.quantized(name)
    if stored is None:
        return None
    data, scale, block = stored
    return (
        fp4_from_checkpoint(data, scale, device)
        if block is None
        else fp8_from_checkpoint(data, scale, block, device)
    )


def _tensors_of(obj: object) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if hasattr(obj, "__dataclass_fields__"):
        out = []
        for name in obj.__dataclass_fields__:
            out.extend(_tensors_of(getattr(obj, name)))
        return out
    return []
