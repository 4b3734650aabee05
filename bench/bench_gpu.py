"""GPU benchmark of the proxy model (see bench/proxy.py) and the transformers peer, in one run.

Measures, in the same process: the device copy bandwidth and the bf16 matmul rate (the two
ceilings), then per weight variant batch-1 decode at 512 and 8192 tokens of context (eager torch
reference path, eager with kernels, CUDA graph) after a prefill of that context in the engine's default chunks
(its prompt rate reported, the chunk regions compiled by a warm-up before), prefill at chunks of 512 / 2048 / 8192, and
transformers' DeepseekV4ForCausalLM on a 4-layer truncation of the proxy. Writes a JSON file and
prints a markdown table. Kernel tables come from ``bench/graph_timeline.py``, in a process of its own:
once ``torch.profiler`` has run in a process, every later graph launch there costs the host about
0.5 us per graph node (1.5 ms for the decode graph), which the GPU then waits for. Usage (GPU
machine, repository root)::

    PYTHONPATH=. python3 bench/bench_gpu.py --out $OUT/bench.json

``--synthetic-state`` skips the prefill of each context: its committed rows are made random in place
(``bench/long_state.py``), which a decode step reads as it reads prefilled ones (a million-token context in seconds).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import statistics
import sys
import time
import traceback
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from long_state import synthetic_state  # noqa: E402
from proxy import build_proxy, bytes_per_token, flash_config, params_per_token  # noqa: E402

from ds4serve import kernels  # noqa: E402
from ds4serve.engine.cuda_graphs import DecodeGraph, VerifyGraph  # noqa: E402
from ds4serve.engine.engine import GPU_CHUNK_TOKENS, Engine  # noqa: E402


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def cuda_ms(fn, reps: int, warmup: int = 2) -> float:
    """Median of ``reps`` event-timed calls of ``fn``, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def prefill_once(engine: Engine, state, ids: list[int]) -> None:
    """One prefill of the prompt ``ids`` from an empty state, as a server runs it: ``Engine.prefill`` (one
    chunk when the engine's chunk size is ``len(ids)``; its first-chunk CUDA graph where one applies), the
    chunk's commit and its last row's logits."""
    state.reset()
    engine.prefill(state, ids)


def ceilings() -> dict:
    n = 1 << 31  # 4 GiB of bf16 per buffer
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = cuda_ms(partial(dst.copy_, src), 10)
    copy = 2 * src.numel() * src.element_size() / ms / 1e6  # GB/s, bytes read + written
    del src, dst
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = cuda_ms(partial(torch.matmul, a, b), 10, warmup=3)
    rate = 2 * 8192**3 / ms / 1e9  # TFLOP/s
    del a, b
    torch.cuda.empty_cache()
    return {"copy_GBps": copy, "bf16_matmul_TFLOPs": rate}


PREFILL_CHUNK = GPU_CHUNK_TOKENS  # the chunk of each context's prefill: the engine's default on CUDA
PROGRESS_TOKENS = 1 << 17  # a long prefill logs its progress every this many tokens


def prefill(model, state, ids: list[int], chunk: int) -> None:
    for i in range(0, len(ids), chunk):
        part = ids[i : i + chunk]
        state.commit(model.forward(part, state).delta, len(part))
        if len(ids) > PROGRESS_TOKENS and (i + len(part)) % PROGRESS_TOKENS == 0:
            torch.cuda.synchronize()
            log(f"prefilled {i + len(part):,} of {len(ids):,} tokens")


def decode_ms(step, state, n: int, token: int) -> tuple[float, list[int]]:
    """Median host wall time of ``n`` decode steps (forward, commit, greedy token to the host)."""
    times, tokens = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        logits = step(token, state)
        token = int(logits.argmax())
        times.append((time.perf_counter() - t0) * 1e3)
        tokens.append(token)
    return statistics.median(times[1:] if n > 2 else times), tokens


def eager_step(model):
    def step(token: int, state):
        r = model.forward([token], state, logit_rows=slice(0, 1))
        state.commit(r.delta, 1)
        return r.logits[0]

    return step


def graph_step(graph: DecodeGraph):
    def step(token: int, state):
        return graph.step(token).logits[0]  # the replay commits the token too

    return step


def bench_variant(variant: str, args, ceil: dict) -> dict:
    log(f"building the {variant} proxy ({args.layers} layers)")
    model = build_proxy(variant, layers=args.layers)
    torch.cuda.synchronize()
    out = {
        "variant": variant,
        "weights_GB": model.nbytes() / 1e9,
        "bytes_per_token_GB": bytes_per_token(model) / 1e9,
    }
    log(f"weights {out['weights_GB']:.1f} GB, read per decode token {out['bytes_per_token_GB']:.2f} GB")
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        if (
            not args.synthetic_state
        ):  # compile the chunk regions first, so that no context's prefill time holds it
            warm = torch.randint(3, 128000, (2 * PREFILL_CHUNK,), generator=gen).tolist()
            prefill(model, model.new_state(len(warm) + 16), warm, PREFILL_CHUNK)
        for ctx in args.contexts:
            ids = torch.randint(3, 128000, (ctx,), generator=gen).tolist()
            capacity = ctx + (args.steps + 4) * 2 + 16
            row: dict = {"synthetic_state": args.synthetic_state}
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            if args.synthetic_state:
                state = synthetic_state(model, ctx, capacity, seed=ctx)
            else:
                state = model.new_state(capacity)
                prefill(model, state, ids, PREFILL_CHUNK)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            row["state_GiB"] = state.nbytes() / 2**30
            row["peak_GiB"] = (
                torch.cuda.max_memory_allocated() / 2**30
            )  # weights, state, the prefill's activations
            log(
                f"ctx {ctx}: the sequence's state {row['state_GiB']:.2f} GiB, peak memory {row['peak_GiB']:.1f} GiB"
            )
            if args.synthetic_state:
                log(f"ctx {ctx}: synthetic state made in {seconds:.1f} s")
            else:
                row["prefill_s"], row["prefill_tokens_per_s"] = seconds, ctx / seconds
                log(
                    f"ctx {ctx}: prefilled in {seconds:.1f} s ({ctx / seconds:,.0f} tok/s, chunks of {PREFILL_CHUNK})"
                )
            if variant == "bf16" and ctx == args.contexts[0]:
                with kernels.disabled():
                    row["eager_torch_ms"], _ = decode_ms(eager_step(model), state, 4, ids[-1])
                log(f"ctx {ctx}: eager torch reference path {row['eager_torch_ms']:.1f} ms/token")
            row["eager_kernels_ms"], _ = decode_ms(eager_step(model), state, 4, ids[-1])
            log(f"ctx {ctx}: eager with kernels {row['eager_kernels_ms']:.1f} ms/token")
            graph = DecodeGraph(model, state)
            row["graph_ms"], _ = decode_ms(graph_step(graph), state, args.steps, ids[-1])
            row["graph_replay_gpu_ms"] = cuda_ms(graph.graph.replay, 10)
            ms = row["graph_ms"]
            row["tokens_per_s"] = 1e3 / ms
            row["GBps"] = out["bytes_per_token_GB"] / ms * 1e3
            row["fraction_of_copy_bw"] = row["GBps"] / ceil["copy_GBps"]
            row["replay_fraction_of_copy_bw"] = (
                out["bytes_per_token_GB"] / row["graph_replay_gpu_ms"] * 1e3 / ceil["copy_GBps"]
            )
            log(
                f"ctx {ctx}: graph {ms:.2f} ms/token ({row['tokens_per_s']:.1f} tok/s, {row['GBps']:.0f} GB/s, "
                f"{100 * row['fraction_of_copy_bw']:.1f}% of copy); replay alone {row['graph_replay_gpu_ms']:.2f} ms"
            )
            for width in args.verify_widths:
                verify = VerifyGraph(model, state, width)
                row[f"verify_{width}_replay_gpu_ms"] = cuda_ms(verify.graph.replay, 10)
                log(
                    f"ctx {ctx}: verify block of {width}: {row[f'verify_{width}_replay_gpu_ms']:.2f} ms per replay "
                    f"({row[f'verify_{width}_replay_gpu_ms'] / row['graph_replay_gpu_ms']:.2f}x the decode replay)"
                )
                del verify
            out[f"decode_{ctx}"] = row
            del graph, state
            gc.collect()
            torch.cuda.empty_cache()
        if variant in args.prefill_variants:
            active = params_per_token(model)
            state = model.new_state(max(args.chunks) + 16)
            for chunk in args.chunks:
                ids = torch.randint(3, 128000, (chunk,), generator=gen).tolist()
                run = partial(prefill_once, Engine(model, tokenizer=None, chunk_size=chunk), state, ids)
                key = f"prefill_{chunk}"
                try:
                    ms = cuda_ms(run, 2 if chunk < 8192 else 1, warmup=1)
                except torch.OutOfMemoryError:
                    out[key] = {"error": "out of memory"}
                    log(f"prefill {chunk}: out of memory")
                    gc.collect()
                    torch.cuda.empty_cache()
                    continue
                tps = chunk / ms * 1e3
                frac = 2 * active * tps / (ceil["bf16_matmul_TFLOPs"] * 1e12)
                out[key] = {"ms": ms, "tokens_per_s": tps, "weight_flops_fraction_of_matmul": frac}
                log(
                    f"prefill chunk {chunk}: {ms:.0f} ms, {tps:.0f} tok/s, {100 * frac:.1f}% of the matmul rate"
                )
            del state
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return out


def bench_peer(args) -> dict:
    """transformers' DeepseekV4ForCausalLM, 4 layers of the proxy's shapes, bf16, random init."""
    import transformers
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    cfg = flash_config(layers=4)
    hf_cfg = DeepseekV4Config(**cfg.to_hf_dict())
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = DeepseekV4ForCausalLM(hf_cfg).eval()
    finally:
        torch.set_default_dtype(prev)
    out = {"transformers": transformers.__version__, "layers": 4}
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        ids = torch.randint(3, 128000, (1, 512), generator=gen).cuda()
        res = model(ids, use_cache=True)
        past, token = res.past_key_values, res.logits[:, -1:].argmax(-1)
        times = []
        for _ in range(args.peer_steps):
            t0 = time.perf_counter()
            res = model(token, past_key_values=past, use_cache=True)
            past, token = res.past_key_values, res.logits[:, -1:].argmax(-1)
            token.item()
            times.append((time.perf_counter() - t0) * 1e3)
        out["decode_512_ms"] = statistics.median(times[1:])
        out["decode_ms_per_layer"] = out["decode_512_ms"] / 4
        log(f"peer decode {out['decode_512_ms']:.1f} ms/token over 4 layers")
        ids = torch.randint(3, 128000, (1, 2048), generator=gen).cuda()
        ms = cuda_ms(partial(model, ids, use_cache=False), 2, warmup=1)
        out["prefill_2048_ms"] = ms
        out["prefill_2048_tokens_per_s_4_layers"] = 2048 / ms * 1e3
        log(f"peer prefill 2048: {ms:.0f} ms over 4 layers")
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--variants", default="bf16,fp8,fp8+fp4")
    p.add_argument("--prefill-variants", default="bf16")
    p.add_argument("--layers", type=int, default=43)
    p.add_argument("--contexts", default="512,8192")
    p.add_argument("--chunks", default="512,2048,8192")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--peer-steps", type=int, default=6)
    p.add_argument("--no-peer", action="store_true")
    p.add_argument(
        "--synthetic-state",
        action="store_true",
        help="decode after random committed rows at each context (bench/long_state.py) instead of a prefill: "
        "a million-token context in seconds",
    )
    p.add_argument(
        "--verify-widths",
        default="",
        help="also time a captured verify block of these widths (comma-separated) at each context",
    )
    args = p.parse_args()
    args.verify_widths = [int(w) for w in args.verify_widths.split(",") if w]
    args.contexts = [int(c) for c in args.contexts.split(",") if c]
    args.chunks = [int(c) for c in args.chunks.split(",") if c]
    args.prefill_variants = args.prefill_variants.split(",")
    results: dict = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "command": " ".join(sys.argv),
    }
    try:
        import triton

        results["triton"] = triton.__version__
    except ImportError:
        results["triton"] = None

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")

    results["ceilings"] = ceil = ceilings()
    log(f"copy {ceil['copy_GBps']:.0f} GB/s, bf16 matmul {ceil['bf16_matmul_TFLOPs']:.0f} TFLOP/s")
    save()
    for variant in args.variants.split(","):
        try:
            results[variant] = bench_variant(variant, args, ceil)
        except Exception as exc:  # noqa: BLE001
            results[variant] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            traceback.print_exc()
            gc.collect()
            torch.cuda.empty_cache()
        save()
    if not args.no_peer:
        try:
            results["peer"] = bench_peer(args)
        except Exception as exc:  # noqa: BLE001 - the peer's failure is a result, not a crash
            results["peer"] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            traceback.print_exc()
        save()
    print(summary(results, args.layers))


def summary(r: dict, layers: int) -> str:
    lines = [
        "| variant | ctx | prefill tok/s | eager torch ms | eager kernels ms | graph ms | tok/s | GB/s | % copy "
        "| replay % copy |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for v in ("bf16", "fp8", "fp8+fp4"):
        for key, row in sorted(
            ((k, x) for k, x in r.get(v, {}).items() if k.startswith("decode_") and "graph_ms" in x),
            key=lambda kx: int(kx[0][7:]),
        ):
            f = lambda k, fmt="{:.2f}": fmt.format(row[k]) if k in row else "-"  # noqa: E731
            lines.append(
                f"| {v} | {key[7:]} | {f('prefill_tokens_per_s', '{:,.0f}')} | {f('eager_torch_ms')} | {f('eager_kernels_ms')} | {f('graph_ms')} | "
                f"{f('tokens_per_s', '{:.1f}')} | {f('GBps', '{:.0f}')} | "
                f"{100 * row['fraction_of_copy_bw']:.1f} | {100 * row['replay_fraction_of_copy_bw']:.1f} |"
            )
    for v in ("bf16", "fp8", "fp8+fp4"):
        for key, row in r.get(v, {}).items():
            if key.startswith("prefill_") and "tokens_per_s" in row:
                lines.append(
                    f"prefill {v} chunk {key[8:]}: {row['tokens_per_s']:.0f} tok/s, "
                    f"{100 * row['weight_flops_fraction_of_matmul']:.1f}% of the matmul rate"
                )
    peer = r.get("peer", {})
    if "decode_ms_per_layer" in peer and "graph_ms" in r.get("bf16", {}).get("decode_512", {}):
        ours = r["bf16"]["decode_512"]["graph_ms"] / layers
        lines.append(
            f"per-layer decode: peer {peer['decode_ms_per_layer']:.2f} ms, ours {ours:.3f} ms "
            f"({peer['decode_ms_per_layer'] / ours:.0f}x)"
        )
    lines.append(json.dumps(r.get("ceilings", {})))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
