"""GPU acceptance of the phase profiler (issue 6). Run from the repository root on a GPU machine:

    PYTHONPATH=. python3 bench/profile_gpu.py [--runs 5] [--gen-tokens 32] [--proxy-layers 4]

For a tiny random checkpoint in bf16 (and, unless ``--proxy-layers 0``, a layer-truncated copy of
the real-shape proxy from ``bench/proxy.py``), with decode captured as a CUDA graph (the default:
decode is one ``decode_graph`` record per step) and then eager (decode timed phase by phase), it
runs the same greedy request with DS4SERVE_GPU_PROFILE unset, ``0`` and ``1`` (interleaved, after
one warm-up each) and checks that

- every arm generates the same token ids;
- unset and ``0`` emit no record; ``1`` emits records with ``clock=cuda_event``, also in the
  JSON-lines file named by DS4SERVE_GPU_PROFILE_FILE;

then prints the median decode ms/token per arm (the overhead of the disabled profiler, unset vs 0)
and the phase table of the profiled arm, ready for ``bench/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from ds4serve import Engine, SamplingParams, profiler
from ds4serve.profile_cli import format_table, summarize
from ds4serve.tiny import TinySpec, make_tiny
from ds4serve.tokenizer import Tokenizer

ARMS = ("unset", "0", "1")


def set_arm(arm: str, sink: Path) -> None:
    os.environ.pop("DS4SERVE_GPU_PROFILE", None)
    os.environ["DS4SERVE_GPU_PROFILE_FILE"] = str(sink)
    if arm != "unset":
        os.environ["DS4SERVE_GPU_PROFILE"] = arm
    profiler.configure()  # from the environment, as a CLI does at startup


def run_arms(
    name: str, engine: Engine, prompt: list[int], gen_tokens: int, runs: int, workdir: Path
) -> list[int]:
    params = SamplingParams(max_tokens=gen_tokens, temperature=0.0, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    decode_ms: dict[str, list[float]] = {arm: [] for arm in ARMS}
    records: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    slug = re.sub(r"\W+", "_", name)
    sinks = {arm: workdir / f"{slug}-{arm}.jsonl" for arm in ARMS}
    for arm in ARMS:  # warm-up (allocations, kernel selection, the profiler's event pools)
        set_arm(arm, sinks[arm])
        engine.generate(prompt, params)
    for arm in ARMS:
        sinks[arm].unlink(missing_ok=True)
    for _ in range(runs):
        for arm in ARMS:
            set_arm(arm, sinks[arm])
            with profiler.collect() as got:
                result = engine.generate(prompt, params)
            if result.error is not None:
                raise SystemExit(f"{name} arm {arm}: {result.error.value}: {result.error_message}")
            tokens.setdefault(arm, result.tokens)
            if result.tokens != tokens[arm]:
                raise SystemExit(f"{name} arm {arm}: tokens changed between runs")
            decode_ms[arm].append(result.timings.decode_s * 1e3 / max(len(result.tokens) - 1, 1))
            records[arm] += got
    profiler.configure(enabled=False)

    print(
        f"\n## {name}: {engine.cfg.num_layers} layers, hidden {engine.cfg.hidden_size}, "
        f"{engine.dtype}, {torch.cuda.get_device_name()}, torch {torch.__version__}"
    )
    print(
        f"prompt {len(prompt)} tokens, {gen_tokens} generated, {runs} measured runs per arm (interleaved)\n"
    )
    same = all(tokens[arm] == tokens["unset"] for arm in ARMS)
    print(f"identical token ids in every arm: {same}  ({tokens['unset'][:12]} ...)")
    for arm in ARMS:
        sink_lines = len(sinks[arm].read_text().splitlines()) if sinks[arm].exists() else 0
        clocks = sorted({r["clock"] for r in records[arm]})
        print(f"arm {arm:>5}: {len(records[arm]):>6} records, clocks {clocks}, {sink_lines} JSON lines")
    print("\n| arm | median decode ms/token | min | max |")
    print("|---|---|---|---|")
    for arm in ARMS:
        ms = decode_ms[arm]
        print(f"| {arm} | {statistics.median(ms):.3f} | {min(ms):.3f} | {max(ms):.3f} |")
    base, off = statistics.median(decode_ms["unset"]), statistics.median(decode_ms["0"])
    on = statistics.median(decode_ms["1"])
    print(
        f"\ndisabled (0) vs unset: {100 * (off - base) / base:+.2f}%   enabled (1) vs unset: "
        f"{100 * (on - base) / base:+.2f}%"
    )
    print("\nphase table (profiled arm, all measured runs):\n")
    print(format_table(summarize(records["1"])))
    problems = []
    if not same:
        problems.append("token ids differ between arms")
    if records["unset"] or records["0"] or sinks["unset"].exists() or sinks["0"].exists():
        problems.append("the disabled profiler emitted records")
    if not records["1"] or {r["clock"] for r in records["1"]} != {"cuda_event"}:
        problems.append("the enabled profiler did not emit clock=cuda_event records")
    if sinks["1"].exists() and [json.loads(x) for x in sinks["1"].read_text().splitlines()] != records["1"]:
        problems.append("the JSON-lines sink differs from the records")
    print("RESULT:", "ok" if not problems else "; ".join(problems))
    if problems:
        raise SystemExit(1)
    return tokens["unset"]


def run_model(name: str, engine: Engine, prompt: list[int], args: argparse.Namespace, workdir: Path) -> None:
    generated = {}
    for eager in (False, True):
        engine.eager = eager
        mode = "eager decode" if eager else "CUDA-graph decode"
        generated[mode] = run_arms(f"{name}, {mode}", engine, prompt, args.gen_tokens, args.runs, workdir)
    print(
        f"\n{name}: graph and eager decode give the same tokens: {len(set(map(tuple, generated.values()))) == 1}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--gen-tokens", type=int, default=32)
    parser.add_argument("--proxy-layers", type=int, default=4, help="0 skips the real-shape proxy")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA (or ROCm) GPU")
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 128000, (args.prompt_tokens,), generator=g).tolist()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tiny = make_tiny(work / "tiny", TinySpec(mtp=1))
        engine = Engine.from_pretrained(tiny, device="cuda", dtype="bfloat16", max_batch=1)
        run_model("tiny", engine, prompt, args, work)
        del engine
        torch.cuda.empty_cache()
        if args.proxy_layers > 0:
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from proxy import build_proxy

            model = build_proxy("bf16", layers=args.proxy_layers, device="cuda")
            engine = Engine(
                model, Tokenizer(), max_context=args.prompt_tokens + args.gen_tokens + 8, max_batch=1
            )
            run_model(f"proxy, first {args.proxy_layers} layers", engine, prompt, args, work)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
