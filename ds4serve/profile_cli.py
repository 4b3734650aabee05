"""``ds4serve profile``: a fixed workload with the phase profiler on, summarised per mode.

The workload is one warm-up request, then one measured request: a random prompt of
``--prompt-tokens`` tokens (fixed seed) and ``--gen-tokens`` greedy tokens (the stop token
ignored). The summary gives, for every (mode, scope, layers) group of steps, each phase's mean time
per step, its calls per step and its share of the step; ``compressor`` and ``indexer`` run inside
``attention`` and are shown indented under it. ``other`` is the step's time outside every phase
(embedding, the commit of the state, the host's own work).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from . import profiler
from .cli import Handler, command

TOP_PHASES = tuple(p for p in profiler.PHASES if p not in profiler.SUB_PHASES)
OTHER = "other"


def summarize(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Mean time, calls and share of the step per phase, per ``mode/scope/layers`` group."""
    groups: dict[str, dict[str, Any]] = {}
    for r in records:
        key = f"{r['mode']}/{r['scope']}/{r['layers']}"
        g = groups.setdefault(
            key,
            {
                "mode": r["mode"],
                "scope": r["scope"],
                "layers": r["layers"],
                "clock": r["clock"],
                "steps": 0,
                "tokens": 0,
                "ms": {},
                "calls": {},
            },
        )
        if r["phase"] == profiler.STEP:
            g["steps"] += 1
            g["tokens"] += r["tokens"]
        g["ms"][r["phase"]] = g["ms"].get(r["phase"], 0.0) + r["gpu_ms"]
        g["calls"][r["phase"]] = g["calls"].get(r["phase"], 0) + r["calls"]
    summary = {}
    for key, g in groups.items():
        steps = max(g["steps"], 1)
        step_ms = g["ms"].get(profiler.STEP, 0.0) / steps
        phases: dict[str, dict[str, float]] = {}
        for name in profiler.PHASES:
            if name in g["ms"]:
                ms = g["ms"][name] / steps
                phases[name] = {"ms": ms, "calls": g["calls"][name] / steps, "share": _share(ms, step_ms)}
        other = max(step_ms - sum(phases[p]["ms"] for p in TOP_PHASES if p in phases), 0.0)
        if phases:
            phases[OTHER] = {"ms": other, "calls": 0.0, "share": _share(other, step_ms)}
        summary[key] = {
            "mode": g["mode"],
            "scope": g["scope"],
            "layers": g["layers"],
            "clock": g["clock"],
            "steps": g["steps"],
            "tokens_per_step": g["tokens"] / steps,
            "step_ms": step_ms,
            "phases": phases,
        }
    return summary


def _share(ms: float, step_ms: float) -> float:
    return ms / step_ms if step_ms > 0 else 0.0


def format_table(summary: dict[str, dict[str, Any]]) -> str:
    """One table per group, in the order prefill, decode, verify, draft."""
    order = {m: i for i, m in enumerate(profiler.MODES)}
    out: list[str] = []
    for key in sorted(summary, key=lambda k: (order.get(summary[k]["mode"], len(order)), k)):
        g = summary[key]
        out.append(
            f"{g['mode']}  scope={g['scope']}  layers={g['layers']}  clock={g['clock']}  "
            f"{g['steps']} steps of {g['tokens_per_step']:.1f} tokens, {g['step_ms']:.3f} ms per step"
        )
        out.append(f"  {'phase':<22}{'mean ms':>11}{'calls':>9}{'share':>9}")
        for name, p in g["phases"].items():
            label = f"  {name}" if name in profiler.SUB_PHASES else name
            calls = "" if name == OTHER else f"{p['calls']:.1f}"
            out.append(f"  {label:<22}{p['ms']:>11.3f}{calls:>9}{p['share'] * 100:>8.1f}%")
        out.append("")
    return "\n".join(out)


def plot(summary: dict[str, dict[str, Any]], path: Path) -> None:
    """A stacked bar per group: each phase's share of the step (needs the ``plot`` extra)."""
    try:
        import matplotlib
    except ModuleNotFoundError as exc:
        raise SystemExit("--plot needs matplotlib: pip install 'ds4serve[plot]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(summary)
    segments = (
        "hc_pre",
        "attention",
        "compressor",
        "indexer",
        "hc_post",
        "moe_ffn",
        "output_projection",
        OTHER,
    )
    fig, ax = plt.subplots(figsize=(max(4.0, 1.6 * len(keys) + 2), 4.5))
    bottoms = [0.0] * len(keys)
    for seg in segments:
        heights = []
        for key in keys:
            phases = summary[key]["phases"]
            share = phases.get(seg, {}).get("share", 0.0)
            if seg == "attention":  # its sub-phases are stacked on their own
                share -= sum(phases.get(s, {}).get("share", 0.0) for s in profiler.SUB_PHASES)
            heights.append(max(share, 0.0) * 100)
        if any(heights):
            ax.bar(range(len(keys)), heights, bottom=bottoms, label=seg)
            bottoms = [b + h for b, h in zip(bottoms, heights)]
    labels = [f"{summary[k]['mode']}\n{summary[k]['scope']}\n{summary[k]['step_ms']:.2f} ms" for k in keys]
    ax.set_xticks(range(len(keys)), labels)
    ax.set_ylabel("share of the step (%)")
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


@command("profile", "run a fixed workload with the GPU phase profiler on and print a phase table per mode")
def _profile_args(p: argparse.ArgumentParser) -> Handler:
    p.add_argument("--model", default=None, help="checkpoint directory (default: the built-in tiny model)")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (GPU default)")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--gen-tokens", type=int, default=64)
    p.add_argument(
        "--chunk-size",
        type=int,
        default=None,
        help="longest prefill chunk (default: the engine's, 2048 on CUDA, 512 elsewhere)",
    )
    p.add_argument("--speculative", default=None, help="speculative decoding spec, as for generate")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompt")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured requests before the measured one")
    p.add_argument(
        "--json",
        default="ds4serve-profile.json",
        help="where to write the records and summary (default: %(default)s)",
    )
    p.add_argument("--plot", default=None, metavar="FILE.png", help="also draw a stacked bar chart")
    p.add_argument("--verbose", action="store_true", help="also log every record line")

    def run(a: argparse.Namespace) -> int:
        import torch

        from .cli import default_model_dir
        from .engine import Engine, SamplingParams

        for name in ("prompt_tokens", "gen_tokens", "chunk_size"):
            if getattr(a, name) is not None and getattr(a, name) < 1:
                raise SystemExit(
                    f"--{name.replace('_', '-')}: expected an integer >= 1, got {getattr(a, name)}"
                )
        if a.warmup < 0:
            raise SystemExit(f"--warmup: expected an integer >= 0, got {a.warmup}")
        device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = a.dtype or ("float32" if device == "cpu" else "bfloat16")
        model = Path(a.model) if a.model else default_model_dir()
        engine = Engine.from_pretrained(
            model,
            device=device,
            dtype=dtype,
            chunk_size=a.chunk_size,
            max_context=a.prompt_tokens + a.gen_tokens,
        )
        g = torch.Generator().manual_seed(a.seed)
        prompt = torch.randint(3, engine.cfg.vocab_size, (a.prompt_tokens,), generator=g).tolist()
        params = SamplingParams(max_tokens=a.gen_tokens, temperature=0.0, ignore_eos=True)
        if not a.verbose:
            logging.getLogger("ds4serve.profiler").setLevel(logging.WARNING)
        profiler.configure(enabled=True)
        for _ in range(a.warmup):
            _check(engine.generate(prompt, params, speculative=a.speculative))
        with profiler.collect() as records:
            result = _check(engine.generate(prompt, params, speculative=a.speculative))
        summary = summarize(records)
        print(
            f"model {model}  device {device}  dtype {dtype}  prompt {a.prompt_tokens} tokens  "
            f"generated {len(result.tokens)} tokens\n"
        )
        print(format_table(summary))
        workload = {
            "model": str(model),
            "device": device,
            "dtype": dtype,
            "prompt_tokens": a.prompt_tokens,
            "gen_tokens": a.gen_tokens,
            "chunk_size": engine.chunk_size,
            "speculative": a.speculative,
            "seed": a.seed,
            "generated": result.tokens,
        }
        Path(a.json).write_text(
            json.dumps({"workload": workload, "summary": summary, "records": records}, indent=1) + "\n"
        )
        print(f"wrote {a.json}")
        if a.plot:
            plot(summary, Path(a.plot))
            print(f"wrote {a.plot}")
        return 0

    return run


def _check(result: Any) -> Any:
    if result.error is not None:
        print(f"error: {result.error.value}: {result.error_message}", file=sys.stderr)
        raise SystemExit(1)
    return result
