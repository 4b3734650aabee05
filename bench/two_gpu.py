"""The full-size DeepSeek-V4-Flash shape (43 layers, 256 routed experts, FP8 weights with MXFP4 routed
experts, random weights made directly on each GPU) split over two GPUs, placed two ways:

* ``split``: both shards in this process (:class:`~ds4serve.parallel.SplitModel`);
* ``pipeline``: one process per shard (:class:`~ds4serve.parallel.pipeline.PipelineModel`, NCCL on
  GPUs, gloo on CPU), started as ``python3 -m torch.distributed.run --nproc-per-node 2`` of this
  script; the ranks inherit the environment unchanged. Each rank builds only its own shard.

Both build the same weights: shard ``k`` (layers of range ``k``, on device ``k``) comes from
``proxy._Maker(cfg, variant, device, seed=k)``, the embedding on shard 0, the head on shard 1.
``--placement both`` (the default) runs the split, frees it (the two placements do not fit the GPUs
together), runs the pipeline, and exits non-zero unless both gave the same greedy tokens.

Per placement (one JSON section each, written after every measurement, so a cut-off run still
reports what it did):

* weights, memory allocated (after building, and allocated / peak / reserved at the end) per GPU;
  bytes read per decode token (:func:`proxy.bytes_per_token` summed over the shards);
* the boundary transfer of one decode token's streams ``[1, hc, D]`` and of a prefill chunk's
  ``[chunk, hc, D]``: split, the hand-off copy cuda:0 -> cuda:1 (host wall time of the copy and a
  synchronize of both GPUs); pipeline, half the round trip rank 0 -> 1 -> 0 of the same tensor,
  timed on rank 0 before the pipeline starts serving;
* greedy tokens of the engine on a short prompt (the placements' comparison);
* per context (512, 8192): the prompt prefilled in ``--chunk`` (2048) token chunks, each chunk
  timed; then eager batch-1 decode (forward, commit, greedy token to the host: median ms/token),
  its GB/s and fraction of the sum of both GPUs' measured copy bandwidth, the boundary's share of a
  step, and the same tokens again after restoring a snapshot (determinism); then decode again through
  CUDA graphs, one per shard (:class:`~ds4serve.engine.cuda_graphs.SplitDecodeGraph`) or one per rank
  (:class:`~ds4serve.parallel.pipeline.PipelineDecodeGraph`). The prefill figure
  (``prefill``) is the longest context's prompt: tokens/s over all its chunks, and over the chunks
  after the first (the first chunk of a new length may include Triton compiles);
* speculative decoding through the engine (greedy, ``ignore_eos``) with
  :class:`~ds4serve.engine.drafts.OracleProposer` at each width and acceptance, drafting the
  continuation the verify path itself emits at that width (``spec_gpu.verifier_sequence``: a few
  perfect-oracle runs, which also compile the width's shapes): tokens/s, tokens per verify step,
  acceptance, and whether the tokens equal plain decoding's (the baseline, also timed; in bf16 on
  random weights they need not, near-tied greedy choices flip with the rounding);
* on GPUs: whole prompts of ``--prompts`` tokens through ``Engine.prefill``, eagerly and through one
  first-chunk graph per shard or per rank, and how far apart their last logits are;
* with ``--mtp K`` (the split only: model drafts need the embedding and head in this process), an
  MTP draft block with random weights on the last GPU drafting ``K`` tokens per step (fixed width
  ``K + 1``), its passes eager and as CUDA graphs: random drafts are rejected, so the two tokens/s
  differ by what the draft passes cost per step.

Two H200s (repository root)::

    PYTHONPATH=. python3 bench/two_gpu.py --out $OUT/two_gpu.json

CPU smoke run (tiny dimensions, gloo; well under a minute)::

    PYTHONPATH=. python3 bench/two_gpu.py --out /tmp/two_gpu.json --device cpu --dims tiny --layers 4 \\
        --experts 8 --contexts 64,256 --chunk 64 --steps 4 --spec-tokens 16
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from ds4serve import Engine, SamplingParams
from ds4serve.config import ModelConfig
from ds4serve.engine.cuda_graphs import SplitDecodeGraph
from ds4serve.engine.draft_graphs import MTPGraphs
from ds4serve.engine.drafts import MAX_STATIC_ROWS, MTPProposer, OracleProposer, target_parts
from ds4serve.model import DeepSeekV4
from ds4serve.parallel.pipeline import Groups, PipelineModel, serve_shard, shard_handshake
from ds4serve.parallel.split_model import SplitModel, handoff
from ds4serve.tiny import TinySpec, tiny_config
from ds4serve.tokenizer import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu import ceilings, decode_ms, eager_step, log  # noqa: E402
from proxy import VARIANTS, _Maker, bytes_per_token, flash_config  # noqa: E402
from spec_gpu import timed, verifier_sequence  # noqa: E402

GiB = 2**30
TINY_QUANT = {"bf16": "none", "fp8": "fp8", "fp8+fp4": "fp8+fp4"}  # proxy variant -> ds4serve.tiny mode
Save = Callable[[], None]


# ---- the model -------------------------------------------------------------------------------------
def model_config(args: argparse.Namespace) -> ModelConfig:
    """Flash dims (:func:`proxy.flash_config`), or ``ds4serve.tiny``'s dims for a CPU smoke run."""
    if args.dims == "tiny":
        return tiny_config(
            TinySpec(layers=args.layers, experts=args.experts, quantize=TINY_QUANT[args.variant])
        )
    return flash_config(args.layers, args.experts, args.variant)


def layer_ranges(cfg: ModelConfig, split: int) -> list[range]:
    return [range(0, split), range(split, cfg.num_layers)]


def placement_devices(kind: str) -> list[torch.device]:
    """Device of shard 0 and shard 1: cuda:0 and cuda:1, or the CPU twice."""
    if kind == "cpu":
        return [torch.device("cpu")] * 2
    if torch.cuda.device_count() < 2:
        raise SystemExit("two_gpu.py needs two GPUs (or --device cpu)")
    return [torch.device("cuda", 0), torch.device("cuda", 1)]


def build_shard(cfg: ModelConfig, variant: str, k: int, layers: range, device: torch.device) -> DeepSeekV4:
    """Shard ``k``: its layers made on ``device`` from seed ``k``; the embedding on shard 0, the head
    on the last shard (made in this order, so both placements get the same weights)."""
    mk = _Maker(cfg, variant, device, seed=k)
    blocks = {i: mk.block(i) for i in layers}
    embed = mk.randn(cfg.vocab_size, cfg.hidden_size) if layers.start == 0 else None
    head = mk.head() if layers.stop == cfg.num_layers else None
    shard = DeepSeekV4(cfg, layers, blocks, embed, head, torch.bfloat16, device)
    sync([device])
    log(
        f"shard {k}: layers {layers.start}..{layers.stop - 1} on {device}, {shard.nbytes() / GiB:.1f} GiB of weights"
    )
    return shard


def shard_report(shard: DeepSeekV4) -> dict:
    """What one shard holds and reads per decode token, and its device's memory now."""
    return {
        "layers": [shard.layers.start, shard.layers.stop - 1],
        "device": str(shard.device),
        "weights_GiB": shard.nbytes() / GiB,
        "bytes_per_token": bytes_per_token(shard),
        **memory(shard.device),
    }


def describe_shards(name: str, reports: list[dict], copy_GBps: list[float]) -> dict:
    """The start of a placement's JSON section."""
    return {
        "placement": name,
        "shards": reports,
        "copy_GBps": copy_GBps,
        "bytes_per_token_GB": sum(r["bytes_per_token"] for r in reports) / 1e9,
    }


# ---- measuring ---------------------------------------------------------------------------------------
def sync(devices: list[torch.device]) -> None:
    for d in devices:
        if d.type == "cuda":
            torch.cuda.synchronize(d)


def wall_ms(fn: Callable[[], object], devices: list[torch.device], reps: int, warmup: int = 2) -> float:
    """Median host wall time of ``fn`` followed by a synchronize of ``devices``."""
    times = []
    for i in range(warmup + reps):
        sync(devices)
        t0 = time.perf_counter()
        fn()
        sync(devices)
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_GBps(device: torch.device) -> float:
    """Device copy bandwidth, bytes read + written (on CUDA: :func:`bench_gpu.ceilings`' 4 GiB copy)."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            return ceilings()["copy_GBps"]
    src = torch.randn(1 << 25, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return 2 * src.numel() * src.element_size() / wall_ms(lambda: dst.copy_(src), [device], 5) / 1e6


def memory(device: torch.device) -> dict:
    """The CUDA allocator's figures for ``device`` (none on the CPU)."""
    if device.type != "cuda":
        return {}
    return {
        "allocated_GiB": torch.cuda.memory_allocated(device) / GiB,
        "peak_GiB": torch.cuda.max_memory_allocated(device) / GiB,
        "reserved_GiB": torch.cuda.memory_reserved(device) / GiB,
    }


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 128000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def timed_prefill(model, state, ids: list[int], chunk: int, devices: list[torch.device]) -> list[float]:
    """Prefill ``ids`` in ``chunk``-token pieces; wall ms of each piece (forward and commit)."""
    times = []
    for i in range(0, len(ids), chunk):
        part = ids[i : i + chunk]
        t0 = time.perf_counter()
        state.commit(model.forward(part, state).delta, len(part))
        sync(devices)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


# ---- measurements of either placement (model: a SplitModel or rank 0's PipelineModel) -------------
def measure(model, args: argparse.Namespace, devices: list[torch.device], section: dict, save: Save) -> None:
    """Greedy tokens, decode and prefill per context, speculative decoding; saved after each."""
    context = max(args.spec_prompt + args.spec_tokens, 16 + args.greedy_tokens) + 64
    engine = Engine(model, Tokenizer(), max_context=context, chunk_size=args.chunk)
    engine.eager = True  # the placements are compared on the one path both run: eager steps
    section["greedy"] = greedy(engine, args.greedy_tokens)
    engine.eager = False  # plain decoding of the split then replays its decode graphs
    log(f"{section['placement']}: greedy tokens {section['greedy']['tokens']}")
    save()
    with torch.inference_mode():
        for ctx in args.contexts:
            section[f"ctx_{ctx}"] = decode_context(model, ctx, args, devices, section)
            save()
    if args.contexts:
        section["prefill"] = prefill_summary(section, max(args.contexts), args.chunk)
        save()
    speculative(engine, args, section, save)


def greedy(engine: Engine, new_tokens: int) -> dict:
    """Greedy tokens after a fixed 16-token prompt (compared between the placements)."""
    prompt = random_ids(16, seed=1)
    res = engine.generate(prompt, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
    if not res.ok:
        raise RuntimeError(res.error_message)
    return {"prompt": prompt, "tokens": res.tokens}


def decode_context(
    model, ctx: int, args: argparse.Namespace, devices: list[torch.device], section: dict
) -> dict:
    """Prefill ``ctx`` tokens (chunks timed), eager decode, and decode again after a restore."""
    ids = random_ids(ctx, seed=ctx)
    state = model.new_state(ctx + 2 * args.steps + 8)
    chunk_ms = timed_prefill(model, state, ids, args.chunk, devices)
    snap = state.snapshot()
    ms, tokens = decode_ms(eager_step(model), state, args.steps, ids[-1])
    state.restore(snap)
    _, again = decode_ms(eager_step(model), state, args.steps, ids[-1])
    GBps = section["bytes_per_token_GB"] / ms * 1e3
    row = graph_decode(model, state, snap, ids[-1], args.steps, section)
    row |= {
        "prefill_chunk_ms": chunk_ms,
        "prefill_tokens_per_s": ctx / sum(chunk_ms) * 1e3,
        "eager_decode_ms": ms,
        "tokens_per_s": 1e3 / ms,
        "GBps": GBps,
        "fraction_of_two_gpus_copy": GBps / sum(section["copy_GBps"]),
        "boundary_fraction_of_step": section["boundary"]["decode_ms"] / ms,
        "tokens": tokens,
        "same_tokens_after_restore": tokens == again,
    }
    log(
        f"{section['placement']} ctx {ctx}: prefill {row['prefill_tokens_per_s']:.0f} tok/s, eager decode "
        f"{ms:.1f} ms/token ({row['tokens_per_s']:.1f} tok/s, {100 * row['fraction_of_two_gpus_copy']:.2f}% of "
        f"the two GPUs' copy), same tokens after restore {row['same_tokens_after_restore']}"
    )
    return row


def graph_decode(model, state, snap, token: int, steps: int, section: dict) -> dict:
    """Decode from ``snap`` again through the placement's decode graphs (one per shard or per rank;
    uncaptured on CPU)."""
    state.restore(snap)
    on_gpu = model.device.type == "cuda"
    if isinstance(model, SplitModel):
        graph = SplitDecodeGraph(model, state, graph=on_gpu)
    else:
        graph = model.decode_graph(state, graph=on_gpu)
    ms, tokens = decode_ms(lambda t, _: graph.step(t).logits[0], state, steps, token)
    GBps = section["bytes_per_token_GB"] / ms * 1e3
    log(
        f"{section['placement']}: graph decode {ms:.2f} ms/token ({1e3 / ms:.1f} tok/s, "
        f"{100 * GBps / sum(section['copy_GBps']):.1f}% of the two GPUs' copy)"
    )
    return {
        "graph_decode_ms": ms,
        "graph_tokens_per_s": 1e3 / ms,
        "graph_GBps": GBps,
        "graph_fraction_of_two_gpus_copy": GBps / sum(section["copy_GBps"]),
        "graph_tokens": tokens,
    }


def prefill_summary(section: dict, ctx: int, chunk: int) -> dict:
    """Prefill tokens/s of the longest context's prompt, over all its chunks and after the first."""
    ms = section[f"ctx_{ctx}"]["prefill_chunk_ms"]
    later = (ctx - chunk) / sum(ms[1:]) * 1e3 if len(ms) > 1 else None
    return {
        "context": ctx,
        "chunk": chunk,
        "tokens_per_s": ctx / sum(ms) * 1e3,
        "tokens_per_s_after_first_chunk": later,
    }


def speculative(engine: Engine, args: argparse.Namespace, section: dict, save: Save) -> None:
    """Plain decoding, then the oracle proposer at every width and acceptance, on one prompt."""
    prompt = random_ids(args.spec_prompt, seed=2)
    params = SamplingParams(max_tokens=args.spec_tokens, temperature=0.0, ignore_eos=True)
    timed(engine, prompt, params)  # the split's decode graphs are captured in the first run
    plain, plain_tps = timed(engine, prompt, params)
    out = section["speculative"] = {
        "prompt_tokens": len(prompt),
        "new_tokens": args.spec_tokens,
        "plain_tokens_per_s": plain_tps,
        "runs": [],
    }
    log(f"{section['placement']}: plain decoding through the engine {plain_tps:.2f} tok/s")
    save()
    for width in args.spec_widths:
        known, runs = verifier_sequence(engine, prompt, params, width, plain.tokens, args.oracle_rounds)
        log(f"{section['placement']} width {width}: the verify path's own continuation after {runs} run(s)")
        for p in args.accept:
            res, tps = timed(engine, prompt, params, OracleProposer(known, p, width))
            spec = res.stats.speculative
            row = {
                "width": width,
                "p": p,
                "tokens_per_s": tps,
                "speedup": tps / plain_tps,
                "tokens_per_verify": spec["tokens_per_forward"],
                "acceptance": spec["acceptance_rate"],
                "equal_to_plain": res.tokens == plain.tokens,
            }
            out["runs"].append(row)
            save()
            log(
                f"{section['placement']} speculative width {width} p {p}: {tps:.2f} tok/s "
                f"({row['speedup']:.2f}x plain), {row['tokens_per_verify']:.2f} tokens/verify, "
                f"equal to plain {row['equal_to_plain']}"
            )
    if args.mtp and isinstance(engine.model, SplitModel):
        mtp_drafts(engine, args, prompt, params, plain_tps, out, save)


def mtp_drafts(
    engine: Engine,
    args: argparse.Namespace,
    prompt: list[int],
    params: SamplingParams,
    plain_tps: float,
    out: dict,
    save: Save,
) -> None:
    """Random MTP drafts of ``args.mtp`` tokens per step, the draft passes eager and as graphs."""
    target = target_parts(engine.model)
    weights = _Maker(target.cfg, args.variant, target.device, seed=99).mtp()
    out["mtp"] = []
    graphs = MTPGraphs(
        weights, target, engine.max_context + MAX_STATIC_ROWS, graph=target.device.type == "cuda"
    )
    for static in (False, True):
        for _ in range(2):  # the second run: the first one compiles and captures
            res, tps = timed(
                engine,
                prompt,
                params,
                MTPProposer(weights, target, args.mtp, passes=graphs if static else None, adaptive=False),
            )
        spec = res.stats.speculative
        row = {
            "drafts_per_step": args.mtp,
            "draft_passes": "graphs" if static else "eager",
            "tokens_per_s": tps,
            "vs_plain": tps / plain_tps,
            "tokens_per_verify": spec["tokens_per_forward"],
            "acceptance": spec["acceptance_rate"],
        }
        out["mtp"].append(row)
        save()
        log(
            f"split MTP drafts ({args.mtp} per step, passes {row['draft_passes']}): {tps:.2f} tok/s "
            f"({row['vs_plain']:.2f}x plain), {row['tokens_per_verify']:.2f} tokens/verify"
        )


# ---- the split: both shards in this process ----------------------------------------------------------
def run_split(args: argparse.Namespace, cfg: ModelConfig, results: dict, save: Save) -> None:
    devices = placement_devices(args.device)
    for d in devices:
        if d.type == "cuda":
            torch.cuda.reset_peak_memory_stats(d)  # the copy measurement's buffers are not the model's
    model = SplitModel(
        [
            build_shard(cfg, args.variant, k, r, d)
            for k, (r, d) in enumerate(zip(layer_ranges(cfg, args.split), devices))
        ]
    )
    section = results["split"] = describe_shards(
        "split", [shard_report(s) for s in model.shards], args.copy_gbps
    )
    section["boundary"] = {
        "method": "hand-off copy shard 0 -> shard 1, host wall time with both devices synced",
        "decode_ms": split_handoff_ms(model, 1, args.reps),
        "prefill_chunk_ms": split_handoff_ms(model, args.chunk, args.reps),
    }
    log(
        f"split: boundary {section['boundary']['decode_ms']:.3f} ms per decode step, "
        f"{section['boundary']['prefill_chunk_ms']:.3f} ms per {args.chunk}-token chunk"
    )
    save()
    measure(model, args, devices, section, save)
    if all(d.type == "cuda" for d in devices) and args.prompts:
        section["first_chunks"] = first_chunks(model, args, devices, "split first chunks")
        save()
    section["memory_end"] = [memory(d) for d in devices]
    save()


def first_chunks(
    model: SplitModel | PipelineModel, args: argparse.Namespace, devices: list[torch.device], label: str
) -> list[dict]:
    """Whole prompts of ``--prompts`` tokens (one chunk each) through ``Engine.prefill``, eagerly (an eager
    engine) and through one first-chunk graph per shard or rank (``label``: which, for the log): median wall ms
    of 3 after a warm-up (which captures), and how far the graphs' last logits are from the eager ones."""
    rows = []
    for n in args.prompts:
        ids = random_ids(n, seed=n)
        arms = {}
        for name in ("eager", "graphs"):
            engine = Engine(model, Tokenizer(), max_context=n, chunk_size=max(args.prompts))
            engine.eager = name == "eager"
            state = model.new_state(n)
            times = []
            with torch.inference_mode():
                for _ in range(4):
                    state.reset()
                    sync(devices)
                    t0 = time.perf_counter()
                    logits = engine.prefill(state, ids).float().cpu()
                    times.append((time.perf_counter() - t0) * 1e3)
            arms[name] = (statistics.median(times[1:]), logits)
        (eager_ms, eager), (graph_ms, graph) = arms["eager"], arms["graphs"]
        rows.append(
            {
                "prompt": n,
                "eager_ms": eager_ms,
                "graphs_ms": graph_ms,
                "logits_max_rel": float((graph - eager).abs().max() / eager.abs().max()),
                "same_greedy_token": int(graph.argmax()) == int(eager.argmax()),
            }
        )
        log(
            f"{label}: {n}-token prompt {eager_ms:.1f} ms eagerly, {graph_ms:.1f} ms through the first-chunk graphs "
            f"(logits max rel {rows[-1]['logits_max_rel']:.1e})"
        )
    return rows


def split_handoff_ms(model: SplitModel, tokens: int, reps: int) -> float:
    first, second = model.shards
    hidden = torch.randn(
        tokens, model.cfg.hc_mult, model.cfg.hidden_size, dtype=first.dtype, device=first.device
    )
    return wall_ms(lambda: handoff(hidden, second.device), model.devices, reps)


def release(devices: list[torch.device]) -> None:
    """Give the freed placement's memory back to the GPUs before the pipeline's processes start."""
    gc.collect()
    for d in devices:
        if d.type == "cuda":
            with torch.cuda.device(d):
                torch.cuda.empty_cache()
            log(
                f"{d} after freeing the split: {torch.cuda.memory_allocated(d) / GiB:.2f} GiB allocated, "
                f"{torch.cuda.memory_reserved(d) / GiB:.2f} GiB reserved"
            )


# ---- the pipeline: one process per shard ---------------------------------------------------------------
def launch_pipeline(args: argparse.Namespace, results: dict, save: Save) -> int:
    """Run this script as two torch.distributed ranks; rank 0 writes its section to a side file."""
    side = args.out.with_name(args.out.stem + ".pipeline.json")
    side.unlink(missing_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
        str(Path(__file__).resolve()),
        *args.argv,
        "--placement",
        "pipeline",
        "--out",
        str(side),
        "--copy-gbps",
        ",".join(map(str, args.copy_gbps)),
        "--pipeline-rank",
    ]
    log("starting the pipeline: " + " ".join(cmd))
    rc = subprocess.run(cmd).returncode  # the ranks inherit this environment unchanged
    results["pipeline"] = json.loads(side.read_text())["pipeline"] if side.is_file() else {}
    if rc:
        results["pipeline"]["exit_status"] = rc
    save()
    return rc


def pipeline_rank(args: argparse.Namespace, cfg: ModelConfig) -> None:
    """One rank: build its shard, time the boundary, then serve (rank 1) or measure (rank 0)."""
    timeout = datetime.timedelta(seconds=args.timeout_s)
    rank = int(os.environ["RANK"])
    device = placement_devices(args.device)[rank]
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timeout)
    try:
        groups = Groups.create(timeout)
        if groups.world != 2:
            raise SystemExit(f"the pipeline runs on 2 ranks, got {groups.world}")
        shard = build_shard(cfg, args.variant, rank, layer_ranges(cfg, args.split)[rank], device)
        table = shard_handshake(shard, groups)
        boundary = {
            "method": "NCCL/gloo send + recv rank 0 -> 1 -> 0, half the round trip, timed on rank 0",
            "decode_ms": pipeline_boundary_ms(groups, shard, 1, args.reps),
            "prefill_chunk_ms": pipeline_boundary_ms(groups, shard, args.chunk, args.reps),
        }
        reports = gather(groups, shard_report(shard))
        if rank == 0:
            measure_pipeline(
                args,
                shard,
                groups,
                table,
                describe_shards("pipeline", reports, args.copy_gbps) | {"boundary": boundary},
            )
        else:
            serve_shard(shard, groups, table)
            gather(groups, memory(device))
    finally:
        dist.destroy_process_group()


def measure_pipeline(
    args: argparse.Namespace, shard: DeepSeekV4, groups: Groups, table: list, section: dict
) -> None:
    """Rank 0: drive the pipeline through :func:`measure`, stop the workers, gather their memory."""
    results = {"command": " ".join(sys.argv), "pipeline": section}

    def save() -> None:
        args.out.write_text(json.dumps(results, indent=2) + "\n")

    log(
        f"pipeline: boundary {section['boundary']['decode_ms']:.3f} ms per decode step, "
        f"{section['boundary']['prefill_chunk_ms']:.3f} ms per {args.chunk}-token chunk"
    )
    save()
    model = PipelineModel(shard, groups, table)
    try:
        measure(model, args, [shard.device], section, save)
        if shard.device.type == "cuda" and args.prompts:
            section["first_chunks"] = first_chunks(model, args, [shard.device], "pipeline first chunks")
            save()
    finally:
        model.close()
        section["memory_end"] = gather(groups, memory(shard.device))
        save()


def pipeline_boundary_ms(groups: Groups, shard: DeepSeekV4, tokens: int, reps: int) -> float | None:
    """Half the round trip of ``[tokens, hc, D]`` streams rank 0 -> 1 -> 0 (rank 0's figure; collective)."""
    buf = torch.zeros(
        tokens, shard.cfg.hc_mult, shard.cfg.hidden_size, dtype=shard.dtype, device=shard.device
    )

    def round_trip() -> None:
        if groups.rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        else:
            dist.recv(buf, 0)
            dist.send(buf, 0)

    ms = wall_ms(round_trip, [shard.device], reps)
    return ms / 2 if groups.rank == 0 else None


def gather(groups: Groups, obj: object) -> list:
    """Every rank's ``obj``, in rank order (collective)."""
    out: list = [None] * groups.world
    dist.all_gather_object(out, obj, group=groups.objects)
    return out


# ---- main ---------------------------------------------------------------------------------------------------
def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--placement", default="both", choices=("split", "pipeline", "both"))
    p.add_argument(
        "--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a smoke run (use --dims tiny)"
    )
    p.add_argument(
        "--dims", default="flash", choices=("flash", "tiny"), help="tiny: ds4serve.tiny's dimensions"
    )
    p.add_argument("--variant", default="fp8+fp4", choices=VARIANTS)
    p.add_argument("--layers", type=int, default=43)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument(
        "--split", type=int, default=None, help="first layer of shard 1 (default: half, rounded up)"
    )
    p.add_argument("--contexts", default="512,8192")
    p.add_argument("--chunk", type=int, default=2048, help="prefill chunk, tokens")
    p.add_argument(
        "--prompts",
        default="512,2048",
        help="on GPUs: whole prompts through Engine.prefill, eagerly "
        "and through the first-chunk graphs (one per shard or rank)",
    )
    p.add_argument("--steps", type=int, default=8, help="decode steps per context")
    p.add_argument("--reps", type=int, default=20, help="repetitions of each boundary timing")
    p.add_argument("--greedy-tokens", type=int, default=16)
    p.add_argument("--spec-widths", default="2,3,4,5,6")
    p.add_argument("--accept", default="0.5,0.9")
    p.add_argument("--spec-prompt", type=int, default=64)
    p.add_argument("--spec-tokens", type=int, default=32)
    p.add_argument(
        "--oracle-rounds",
        type=int,
        default=2,
        help="perfect-oracle runs per width that find the verify path's own continuation",
    )
    p.add_argument(
        "--mtp",
        type=int,
        default=0,
        help="split: also time K random MTP drafts per step, eager and as graphs (0: not)",
    )
    p.add_argument("--timeout-s", type=float, default=300.0, help="pipeline: longest wait for a peer")
    p.add_argument("--copy-gbps", default=None, help=argparse.SUPPRESS)  # measured once, handed to the ranks
    p.add_argument("--pipeline-rank", action="store_true", help=argparse.SUPPRESS)  # set by launch_pipeline
    args = p.parse_args(argv)
    args.argv = argv
    args.split = args.split or -(-args.layers // 2)
    args.contexts = [int(c) for c in args.contexts.split(",") if c]
    args.prompts = [int(n) for n in args.prompts.split(",") if n]
    args.spec_widths = [int(w) for w in args.spec_widths.split(",") if w]
    args.accept = [float(a) for a in args.accept.split(",") if a]
    if args.copy_gbps is not None:
        args.copy_gbps = [float(x) for x in args.copy_gbps.split(",")]
    if not 0 < args.split < args.layers:
        raise SystemExit(f"--split: expected 1..{args.layers - 1}, got {args.split}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    cfg = model_config(args)
    if args.pipeline_rank:
        pipeline_rank(args, cfg)
        return 0
    devices = placement_devices(args.device)
    results: dict = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "torch": torch.__version__,
        "devices": [torch.cuda.get_device_name(d) if d.type == "cuda" else "cpu" for d in devices],
        "dims": args.dims,
        "variant": args.variant,
        "layers": args.layers,
        "experts": args.experts,
        "split_at_layer": args.split,
    }

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")

    args.copy_gbps = results["copy_GBps"] = [copy_GBps(d) for d in devices]
    log(f"copy bandwidth {', '.join(f'{x:.0f}' for x in args.copy_gbps)} GB/s")
    save()
    rc = 0
    if args.placement in ("split", "both"):
        try:
            run_split(args, cfg, results, save)
        except Exception as exc:  # noqa: BLE001 - a failed split is a result; the pipeline still runs
            traceback.print_exc()
            results.setdefault("split", {})["error"] = f"{type(exc).__name__}: {exc}"[:500]
            save()
            rc = 1
        release(devices)
    if args.placement in ("pipeline", "both"):
        rc = launch_pipeline(args, results, save) or rc
    if args.placement == "both":
        rc = compare_greedy(results) or rc
        save()
    return rc


def compare_greedy(results: dict) -> int:
    """Record whether both placements gave the same greedy tokens (None: one has none); 0 if they did."""
    split, pipeline = (results[p].get("greedy", {}).get("tokens") for p in ("split", "pipeline"))
    same = None if split is None or pipeline is None else split == pipeline
    results["greedy_identical"] = same
    log(f"greedy tokens identical between the split and the pipeline: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
