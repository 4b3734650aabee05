"""Train a small DeepSeek-V4 with its MTP block on the Python standard library, write it as a checkpoint.

The model is the project's own: :meth:`DeepSeekV4.forward` over a fresh state and :func:`mtp_forward`, the
torch reference (``kernels.disabled()``), built each step from fp32 leaf tensors (the loader casts them to
the run's dtype, so gradients reach the leaves). Loss: next-token cross-entropy + ``--mtp-weight`` times the
MTP block's (row ``i``: the trunk's streams ``H_i`` and the embedding of token ``i+1`` predict token
``i+2``). The forward takes one sequence; a step accumulates ``--batch`` sequences.

Only tokens seen at least ``--min-count`` times in the training text get embedding and head rows; the others'
rows are zero (git compresses them) and stay zero: the loss is the full-vocabulary cross-entropy with their
logits fixed at 0 (:func:`vocab_ce`), which is what the written checkpoint computes.

Writes the checkpoint as a released one is stored (:func:`write_released`): by default (``--quantize fp8``)
in the official layout with the projections and routed experts in FP8 e4m3 with block scales, as tiny.py
writes an fp8 tiny checkpoint (``fp8+fp4``: MXFP4 routed experts; ``none``: the transformers layout, BF16
projections), the rest in the released dtypes (BF16, F32 mixers); with ``train_metrics.json``: the
held-out perplexity of the written (quantized) checkpoint scored by the engine, training losses, tokens
seen, timings, config and corpus. ``--minutes`` bounds the training loop; ``--steps`` alone makes a run
reproducible (the learning-rate schedule follows max(step/steps, elapsed/minutes)). The shipped model's run
(docs/BENCHMARKS.md has the command that also packs it):

    PYTHONPATH=. python3 bench/train_tiny.py --device cuda --minutes 6.3 --out /tmp/deepseek-v4-tiny-stdlib
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from stdlib_corpus import Corpus, load_corpus  # noqa: E402

from ds4serve import kernels  # noqa: E402
from ds4serve.config import CSA, HCA, SLIDING, ModelConfig  # noqa: E402
from ds4serve.engine import Engine  # noqa: E402
from ds4serve.model.deepseek4 import DeepSeekV4  # noqa: E402
from ds4serve.model.mtp import MTPWeights, load_mtp, mtp_forward, mtp_logits  # noqa: E402
from ds4serve.state import allocate_layer  # noqa: E402
from ds4serve.tiny import (  # noqa: E402
    QUANT_MODES,
    TinySpec,
    _quantize,
    _released_dtype,
    quant_spec,
    random_tensors,
    tiny_config,
    write_checkpoint,
)
from ds4serve.tokenizer import Tokenizer  # noqa: E402

_EXPERT_PART = ".ffn.experts."
_FROZEN = ("ffn.gate.tid2eid", "ffn.gate.bias")  # hash tables; the selection-only bias (no gradient)


@dataclass
class ModelSize:
    hidden: int = 192
    layers: int = 6
    heads: int = 4
    head_dim: int = 64
    rope_dim: int = 16
    q_lora: int = 128
    o_lora: int = 64
    experts: int = 8
    top_k: int = 2
    moe_inter: int = 128
    window: int = 128
    hca_rate: int = 32
    index_heads: int = 8
    index_head_dim: int = 32
    index_topk: int = 64


def model_config(size: ModelSize) -> ModelConfig:
    """tiny.py's layer pattern (2 sliding, then CSA / HCA alternating; 3 hash-routed layers) at ``size``,
    with one MTP block."""
    spec = TinySpec(
        layers=size.layers,
        experts=size.experts,
        top_k=size.top_k,
        hidden=size.hidden,
        heads=size.heads,
        head_dim=size.head_dim,
        rope_dim=size.rope_dim,
        window=size.window,
        hca_rate=size.hca_rate,
        index_topk=size.index_topk,
        index_heads=size.index_heads,
        index_head_dim=size.index_head_dim,
        mtp=1,
    )
    return dataclasses.replace(
        tiny_config(spec), q_lora_rank=size.q_lora, o_lora_rank=size.o_lora, moe_inter=size.moe_inter
    )


def kept_tokens(stream: torch.Tensor, min_count: int, always: tuple[int, ...]) -> torch.Tensor:
    """Sorted ids of the tokens with rows: seen ``min_count`` times in ``stream``, and ``always``."""
    seen = torch.bincount(stream, minlength=max(int(stream.max()), *always) + 1) >= min_count
    seen[list(always)] = True
    return seen.nonzero().flatten()


class Weights:
    """fp32 leaves by official name (routed experts stacked ``[E, out, in]`` as ``<block>.ffn.experts.wN``;
    ``embed.rows`` / ``head.rows`` for the kept tokens) and the frozen tensors; duck-types the part of
    :class:`ds4serve.weights.Checkpoint` that :meth:`DeepSeekV4.load` and :func:`load_mtp` read."""

    def __init__(self, cfg: ModelConfig, kept: torch.Tensor, seed: int, device: torch.device):
        self.cfg = cfg
        self.kept = kept.to(device)
        init = random_tensors(cfg, seed)
        self.params: dict[str, torch.Tensor] = {}
        self.frozen: dict[str, torch.Tensor] = {}
        for name, t in init.items():
            if _EXPERT_PART in name:
                continue
            if name.endswith("ffn.gate.bias"):
                t = torch.zeros_like(t)
            elif name.endswith("norm.weight"):
                t = torch.ones_like(t)
            elif name in ("embed.weight", "head.weight"):
                name, t = name.split(".")[0] + ".rows", t[kept]
            (self.frozen if name.endswith(_FROZEN) else self.params)[name] = t.to(device)
        for block in [f"layers.{i}" for i in range(cfg.num_layers)] + ["mtp.0"]:
            for w in ("w1", "w2", "w3"):
                parts = [init[f"{block}.ffn.experts.{e}.{w}.weight"] for e in range(cfg.n_routed_experts)]
                self.params[f"{block}.ffn.experts.{w}"] = torch.stack(parts).to(device)
        for t in self.params.values():
            t.requires_grad_(True)
        self._embed: torch.Tensor | None = None

    # ---- what the loaders read ----------------------------------------------------------------
    def dense(self, name: str, dtype: torch.dtype = torch.float32, device: object = None) -> torch.Tensor:
        if name in self.frozen:
            t = self.frozen[name]
            return t if not t.is_floating_point() else t.to(dtype)
        if name == "embed.weight":
            return self._embed.to(dtype)
        if name == "head.weight":
            return self.params["head.rows"].to(dtype)
        return self.params[name].to(dtype)

    def experts(self, prefix: str, which: str, dtype: torch.dtype, device: object = None) -> torch.Tensor:
        return self.params[f"{prefix}.ffn.experts.{which}"].to(dtype)

    def quantized(self, name: str) -> None:
        return None

    # ---- the model ----------------------------------------------------------------------------
    def build(self, dtype: torch.dtype) -> tuple[DeepSeekV4, MTPWeights]:
        """The trunk and MTP block over the current leaves (the head holds the kept rows only)."""
        rows = self.params["embed.rows"]
        full = rows.new_zeros(self.cfg.vocab_size, rows.shape[1])
        self._embed = full.index_copy(0, self.kept, rows)
        device = rows.device
        return DeepSeekV4.load(self, dtype=dtype, device=device), load_mtp(self, 0, dtype, device)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor by official name, float32 (zero rows for other tokens); :func:`write_released`
        stores them."""
        out: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name, t in {**self.params, **self.frozen}.items():
                t = t.detach().cpu()
                if name.endswith(".rows"):
                    full = t.new_zeros(self.cfg.vocab_size, t.shape[1])
                    out[name.split(".")[0] + ".weight"] = full.index_copy(0, self.kept.cpu(), t)
                elif _EXPERT_PART in name:
                    block, w = name.split(_EXPERT_PART)
                    for e, part in enumerate(t.unbind(0)):
                        out[f"{block}{_EXPERT_PART}{e}.{w}.weight"] = part.clone()
                else:
                    out[name] = t
        return out


def vocab_ce(logits: torch.Tensor, targets: torch.Tensor, slot: torch.Tensor, vocab: int) -> torch.Tensor:
    """Mean full-vocabulary cross-entropy from the kept tokens' logits ``[N, K]``, the other ``vocab - K``
    logits being 0 (zero head rows); ``slot [vocab]``: a token's column, -1 for a token without a row."""
    n_zero = vocab - logits.shape[1]
    lse = torch.logaddexp(
        torch.logsumexp(logits, dim=-1), torch.tensor(math.log(n_zero), device=logits.device)
    )
    col = slot[targets]
    hit = logits.gather(1, col.clamp(min=0).unsqueeze(1)).squeeze(1)
    return (lse - torch.where(col >= 0, hit, 0.0)).mean()


def sequence_losses(
    weights: Weights, model: DeepSeekV4, mtp: MTPWeights, window: torch.Tensor, slot: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(next-token CE, MTP CE)`` of one sequence ``window [S + 2]``: the trunk reads tokens ``0..S-1``
    from a fresh state; MTP row ``i`` (position ``i`` of its own fresh window) predicts token ``i + 2``."""
    cfg, S = weights.cfg, window.shape[0] - 2
    ids, nxt, nxt2 = window[:S], window[1 : S + 1], window[2:]
    result = model.forward(ids, model.new_state(S))
    ce = vocab_ce(model.logits(result.hidden), nxt, slot, cfg.vocab_size)
    layer = allocate_layer(cfg, SLIDING, S, model.dtype, model.device)
    streams, _ = mtp_forward(
        mtp, result.hidden, nxt, model.embed[nxt], model.chunk_info(0, S), layer, cfg, model.ropes
    )
    mtp_ce = vocab_ce(mtp_logits(mtp, streams, model.head, cfg), nxt2, slot, cfg.vocab_size)
    return ce, mtp_ce


@dataclass
class TrainArgs:
    steps: int | None = None  # None: until ``minutes``
    minutes: float | None = None  # None: until ``steps``
    batch: int = 2
    seq_len: int = 4096
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 50
    weight_decay: float = 0.1
    mtp_weight: float = 0.3
    seed: int = 0
    log_every: int = 10


def _lr(args: TrainArgs, step: int, progress: float) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    cos = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * cos)


def train(weights: Weights, stream: torch.Tensor, args: TrainArgs, dtype: torch.dtype) -> dict:
    """AdamW with warmup and cosine decay over random windows of ``stream`` (``seq_len + 2`` tokens each)
    until ``args.steps`` or ``args.minutes``; returns ``history`` (per step: mean losses over the batch,
    tokens so far), ``seconds``, ``steps`` and ``tokens``."""
    if args.steps is None and args.minutes is None:
        raise ValueError("train: give steps or minutes")
    device = weights.kept.device
    slot = torch.full((weights.cfg.vocab_size,), -1, dtype=torch.long, device=device)
    slot[weights.kept] = torch.arange(weights.kept.numel(), device=device)
    decay = [t for t in weights.params.values() if t.dim() >= 2]
    no_decay = [t for t in weights.params.values() if t.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    gen = torch.Generator().manual_seed(args.seed)
    stream = stream.to(device)
    budget = None if args.minutes is None else args.minutes * 60
    history: list[dict] = []
    start = time.perf_counter()
    tokens = 0
    step = 0
    while args.steps is None or step < args.steps:
        elapsed = time.perf_counter() - start
        if budget is not None and elapsed >= budget:
            break
        progress = max(step / args.steps if args.steps else 0.0, elapsed / budget if budget else 0.0)
        for group in opt.param_groups:
            group["lr"] = _lr(args, step, progress)
        offsets = torch.randint(0, stream.numel() - args.seq_len - 1, (args.batch,), generator=gen)
        ce_sum = mtp_sum = torch.zeros((), device=device)
        with kernels.disabled():
            model, mtp = weights.build(dtype)
            for off in offsets.tolist():
                ce, mtp_ce = sequence_losses(weights, model, mtp, stream[off : off + args.seq_len + 2], slot)
                ((ce + args.mtp_weight * mtp_ce) / args.batch).backward(retain_graph=True)
                ce_sum = ce_sum + ce.detach()
                mtp_sum = mtp_sum + mtp_ce.detach()
                del ce, mtp_ce  # this sequence's graph: freed before the next one is built
        torch.nn.utils.clip_grad_norm_(list(weights.params.values()), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        tokens += args.batch * args.seq_len
        row = {"step": step, "loss": ce_sum.item() / args.batch, "mtp_loss": mtp_sum.item() / args.batch}
        row["tokens"] = tokens
        history.append(row)
        if step % args.log_every == 0 or step == 1:
            elapsed = time.perf_counter() - start
            print(
                f"step {step} loss {row['loss']:.4f} mtp {row['mtp_loss']:.4f} lr {opt.param_groups[0]['lr']:.2e} "
                f"tok/s {tokens / elapsed:.0f} elapsed {elapsed:.0f}s",
                flush=True,
            )
    return {"history": history, "seconds": time.perf_counter() - start, "steps": step, "tokens": tokens}


def heldout_nll(engine: Engine, docs: list[list[int]], max_tokens: int, max_len: int) -> tuple[float, int]:
    """``(mean NLL per predicted token, tokens predicted)`` of the engine over ``docs``, each scored from its
    start and cut to ``max_len`` tokens, until ``max_tokens`` predictions."""
    total, count = 0.0, 0
    for doc in docs:
        ids = doc[: min(max_len, max_tokens - count + 1)]
        if len(ids) < 2:
            break
        logits = engine.score(ids)[:-1]
        target = torch.tensor(ids[1:], device=logits.device)
        total += F.cross_entropy(logits.float(), target, reduction="sum").item()
        count += len(ids) - 1
        if count >= max_tokens:
            break
    return total / count, count


def write_released(out: Path, cfg: ModelConfig, tensors: dict[str, torch.Tensor], quantize: str) -> Path:
    """``tensors`` (official names; float ones in any dtype) written as a released checkpoint, the tokenizer
    files beside it: ``none``, the transformers layout in the released dtypes (BF16 projections, F32
    mixers); ``fp8`` / ``fp8+fp4``, the official layout quantized as tiny.py quantizes (FP8 e4m3
    projections, FP8 or MXFP4 routed experts, each with its F8_E8M0 block scales), its config.json also
    naming the layer pattern in transformers' keys (:func:`readable_by_transformers`)."""
    if quantize not in QUANT_MODES:
        raise ValueError(f"--quantize: expected one of {QUANT_MODES}, got {quantize!r}")
    if quantize == "none":
        released = {n: t.to(_released_dtype(n)) if t.is_floating_point() else t for n, t in tensors.items()}
        return write_checkpoint(out, cfg, released, "hf")
    cfg = dataclasses.replace(cfg, quant=quant_spec(quantize))
    out = write_checkpoint(out, cfg, _quantize(tensors, cfg), "official")
    readable_by_transformers(out, cfg)
    return out


def readable_by_transformers(folder: Path, cfg: ModelConfig) -> None:
    """Add ``layer_types`` and ``compress_rates`` to an official-layout config.json: transformers maps the
    official ``compress_ratios`` only from the real model's ratios (0, 4, 128) and refuses others (this
    model's HCA ratio), so ``AutoTokenizer``, which reads config.json, could not load the folder. Both
    readers prefer the explicit keys; the engine reads the same config from either."""
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    raw["layer_types"] = list(cfg.layer_types)
    raw["compress_rates"] = {CSA: cfg.csa_rate, HCA: cfg.hca_rate}
    path.write_text(json.dumps(raw, indent=2) + "\n")


def write_trained(out: Path, weights: Weights, quantize: str) -> Path:
    """The trained weights written by :func:`write_released` (quantized from their float32 values)."""
    return write_released(out, weights.cfg, weights.checkpoint_tensors(), quantize)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default=None, help="default: bf16 on CUDA")
    p.add_argument("--minutes", type=float, default=None, help="training wall budget (default: --steps)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: --minutes)")
    p.add_argument("--min-count", type=int, default=3)
    p.add_argument("--quantize", choices=QUANT_MODES, default="fp8", help="how the checkpoint is stored")
    p.add_argument("--eval-tokens", type=int, default=32768)
    p.add_argument("--eval-len", type=int, default=2048)
    p.add_argument("--limit-files", type=int, default=None, help="only the first N stdlib files (tests)")
    for f in dataclasses.fields(TrainArgs):
        if f.name not in ("steps", "minutes"):
            p.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    for f in dataclasses.fields(ModelSize):
        p.add_argument("--" + f.name.replace("_", "-"), type=int, default=f.default)
    a = p.parse_args(argv)
    torch.manual_seed(a.seed)
    device = torch.device(a.device)
    dtype = getattr(torch, a.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    size = ModelSize(**{f.name: getattr(a, f.name) for f in dataclasses.fields(ModelSize)})
    args = TrainArgs(**{f.name: getattr(a, f.name) for f in dataclasses.fields(TrainArgs)})
    if a.steps is None and a.minutes is None:
        p.error("give --steps, --minutes or both")

    t0 = time.perf_counter()
    tokenizer = Tokenizer()
    corpus: Corpus = load_corpus(tokenizer, limit_files=a.limit_files)
    print(f"corpus {json.dumps(corpus.meta)} in {time.perf_counter() - t0:.0f}s", flush=True)
    if not corpus.heldout:
        p.error(f"no held-out file among the {corpus.meta['files']} read: raise --limit-files")
    cfg = model_config(size)
    kept = kept_tokens(corpus.train, a.min_count, (tokenizer.bos_id, tokenizer.eos_id))
    weights = Weights(cfg, kept, a.seed, device)
    n_params = sum(t.numel() for t in weights.params.values())
    print(f"{n_params / 1e6:.1f}M parameters, {kept.numel()} tokens with rows, {dtype}, {device}", flush=True)

    run = train(weights, corpus.train, args, dtype)
    t1 = time.perf_counter()
    out = write_trained(a.out, weights, a.quantize)
    t2 = time.perf_counter()
    with kernels.disabled():
        engine = Engine.from_pretrained(out, device=device, dtype=dtype, eager=True)
        nll, n_eval = heldout_nll(engine, corpus.heldout, a.eval_tokens, a.eval_len)
    t3 = time.perf_counter()
    tail = run["history"][-20:] or [{"loss": float("nan"), "mtp_loss": float("nan")}]
    metrics = {
        "heldout": {"loss": nll, "perplexity": math.exp(nll), "tokens": n_eval},
        "train": {
            "loss": sum(r["loss"] for r in tail) / len(tail),
            "mtp_loss": sum(r["mtp_loss"] for r in tail) / len(tail),
            "steps": run["steps"],
            "tokens_seen": run["tokens"],
            "tokens_per_second": run["tokens"] / max(run["seconds"], 1e-9),
        },
        "seconds": {"train": run["seconds"], "write": t2 - t1, "eval": t3 - t2, "total": t3 - t0},
        "corpus": corpus.meta,
        "model": dataclasses.asdict(size),
        "training": {
            **dataclasses.asdict(args),
            "min_count": a.min_count,
            "dtype": str(dtype),
            "device": str(device),
        },
        "quantize": a.quantize,
        "parameters": n_params,
        "kept_tokens": kept.numel(),
        "checkpoint_bytes": sum(f.stat().st_size for f in out.glob("*.safetensors")),
        "history": run["history"],
    }
    (out / "train_metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    print(
        f"held-out loss {nll:.4f} perplexity {math.exp(nll):.2f} over {n_eval} tokens; wrote {out} "
        f"({metrics['checkpoint_bytes'] / 1e6:.1f} MB) in {t3 - t0:.0f}s",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
