"""One speculative request on the built-in model, timed and profiled: where a verify step's time goes.

Decodes the first 128 tokens of a held-out standard-library file with plain decoding and with MTP at fixed
widths 1..3 (``--reps`` rounds over the widths in turn, so that a slow spell of the host hits every width alike;
the fastest and the median run are reported), then, unless ``--no-profile``, profiles one plain and
one width-1 request with cProfile (host functions) and, on a GPU, torch.profiler (host calls such as
``cudaMemcpyAsync`` and ``cudaGraphLaunch`` against device kernels); ``--trace DIR`` writes torch.profiler's
Chrome traces of a plain, a width-1 and a width-3 request of ``--trace-tokens`` tokens (host calls and kernels
on one timeline) and prints each one's device busy time (:func:`device_busy`): how much of a request is the
device's own work, which no host change removes. Run it in two checkouts in one device call to compare two
commits.

    PYTHONPATH=. python3 bench/spec_step.py [--tokens 128] [--reps 5] [--no-profile] [--trace DIR]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from stdlib_corpus import heldout_documents  # noqa: E402

from ds4serve import Engine, SamplingParams  # noqa: E402
from ds4serve.cli import default_model_dir  # noqa: E402
from ds4serve.engine.drafts import resolve_proposer  # noqa: E402
from ds4serve.engine.request import GenerateResult  # noqa: E402
from ds4serve.tokenizer import Tokenizer  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=5, help="timed rounds over the widths")
    p.add_argument("--no-profile", action="store_true")
    p.add_argument(
        "--trace", type=Path, default=None, help="folder for Chrome traces of one request (GPU only)"
    )
    p.add_argument("--trace-tokens", type=int, default=48)
    p.add_argument(
        "--trace-top", type=int, default=12, help="kernel names listed for each kind of graph replay"
    )
    a = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = default_model_dir()
    dtype = "bfloat16" if device == "cuda" else "float32"
    engine = Engine.from_pretrained(model, device=device, dtype=dtype, max_batch=1)
    prompt = next(d for d in heldout_documents(Tokenizer(model)) if len(d) > 400)[:128]
    engine.warm_up()

    def generate(width: int | None, tokens: int = a.tokens) -> GenerateResult:
        draft = None
        if width:
            draft = resolve_proposer(engine, f"mtp:{width}")
            draft.adaptive = False
        result = engine.generate(
            prompt, SamplingParams(max_tokens=tokens, ignore_eos=True), speculative=draft
        )
        if not result.ok:
            raise RuntimeError(result.error_message)
        return result

    widths = (None, 1, 2, 3)
    for width in widths:  # untimed: compiles and captures
        generate(width)
    runs: dict[int | None, list[GenerateResult]] = {width: [] for width in widths}
    for _ in range(a.reps):
        for width in widths:
            runs[width].append(generate(width))
    for width, done in runs.items():
        times = sorted(r.timings.decode_s for r in done)
        best, median = times[0], times[len(times) // 2]
        spec = done[-1].stats.speculative or {}
        print(
            f"width {width}: decode {best * 1e3:.1f} ms for {a.tokens} tokens = {a.tokens / best:.0f} tok/s"
            f" (median {median * 1e3:.1f} ms = {a.tokens / median:.0f} tok/s);"
            f" steps {spec.get('steps')} emitted {spec.get('emitted')}",
            flush=True,
        )
    if a.trace is not None and device == "cuda":
        from torch.profiler import ProfilerActivity, profile

        a.trace.mkdir(parents=True, exist_ok=True)
        for width in (None, 1, 3):
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
                result = generate(width, a.trace_tokens)
            path = a.trace / f"trace-{'plain' if width is None else f'w{width}'}.json"
            tp.export_chrome_trace(str(path))
            busy, span, gaps = device_busy(json.loads(path.read_text()))
            steps = (result.stats.speculative or {}).get("steps", a.trace_tokens)
            print(
                f"trace width {width}: device busy {busy / 1e3:.2f} ms of {span / 1e3:.2f} ms"
                f" ({busy / span:.0%}), {steps} steps, idle gaps over 50 us: {sum(g > 50 for g in gaps)}"
                f" ({sum(g for g in gaps if g > 50) / 1e3:.2f} ms)",
                flush=True,
            )
            for line in launch_table(json.loads(path.read_text()), a.trace_top):
                print(f"  {line}", flush=True)
    if a.no_profile:
        return 0
    for width in (None, 1):
        prof = cProfile.Profile()
        prof.enable()
        generate(width)
        prof.disable()
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text)
        stats.sort_stats("tottime").print_stats(40)
        stats.sort_stats("cumulative").print_stats(45)
        print(f"==== cProfile width {width}\n{text.getvalue()}")
        if device == "cuda":
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
                generate(width)
            print(f"==== torch profiler width {width}")
            print(tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
            print(tp.key_averages().table(sort_by="self_cuda_time_total", row_limit=15))
    return 0


def device_busy(trace: dict | list) -> tuple[float, float, list[float]]:
    """A Chrome trace's device work: the time its kernels and copies cover (overlaps merged), the span from the
    first to the last, and the idle gaps between them, in microseconds. Under PDL a kernel's span includes its
    wait for the one before, so the busy time is the device chain's, not the kernels' own."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    spans = sorted(
        (e["ts"], e["ts"] + e.get("dur", 0))
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    )
    if not spans:
        return 0.0, 0.0, []
    merged = [list(spans[0])]
    for start, end in spans[1:]:
        if start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    busy = sum(end - start for start, end in merged)
    gaps = [b[0] - a[1] for a, b in zip(merged, merged[1:])]
    return busy, merged[-1][1] - merged[0][0], gaps


def launches(trace: dict | list) -> dict[tuple[str, int], list[tuple[str, float]]]:
    """A Chrome trace's device kernels grouped by the host call that launched them (a graph replay launches
    many under one correlation id): ``{(host call name, correlation): [(kernel name, us), ...]}``."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    calls = {
        e["args"]["correlation"]: e["name"]
        for e in events
        if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})
    }
    out: dict[tuple[str, int], list[tuple[str, float]]] = {}
    for e in sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"]):
        corr = e.get("args", {}).get("correlation", -1)
        out.setdefault((calls.get(corr, "?"), corr), []).append((e["name"], e.get("dur", 0.0)))
    return out


def launch_table(trace: dict | list, top: int = 12) -> list[str]:
    """Lines describing a trace's graph replays by kind (kernels per replay): how many replays, their kernels'
    time per replay, and one replay's kernels summed by name (largest first); then the kernels launched one at
    a time (outside graphs), by name."""
    kinds: dict[int, list[list[tuple[str, float]]]] = {}
    single: dict[str, list[float]] = {}
    for (call, _), kernels in launches(trace).items():
        if call == "cudaGraphLaunch":
            kinds.setdefault(len(kernels), []).append(kernels)
        else:
            for name, dur in kernels:
                single.setdefault(name, []).append(dur)
    lines = []
    for count, replays in sorted(kinds.items(), key=lambda kv: -len(kv[1]) * kv[0]):
        per = sorted(sum(d for _, d in r) for r in replays)[len(replays) // 2]
        lines.append(f"graph of {count} kernels x {len(replays)} replays: median {per:.1f} us of kernels")
        for name, durs in _by_name(replays[len(replays) // 2])[:top]:
            lines.append(f"    {sum(durs):8.1f} us x {len(durs):3d}  {name[:90]}")
    total = sum(len(d) for d in single.values())
    lines.append(f"outside graphs: {total} kernels, {sum(map(sum, single.values())):.1f} us")
    for name, durs in sorted(single.items(), key=lambda kv: -sum(kv[1]))[:top]:
        lines.append(f"    {sum(durs):8.1f} us x {len(durs):3d}  {name[:90]}")
    return lines


def _by_name(kernels: list[tuple[str, float]]) -> list[tuple[str, list[float]]]:
    named: dict[str, list[float]] = {}
    for name, dur in kernels:
        named.setdefault(name, []).append(dur)
    return sorted(named.items(), key=lambda kv: -sum(kv[1]))


if __name__ == "__main__":
    raise SystemExit(main())
