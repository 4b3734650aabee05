"""Where a batched decode step's GPU time goes: the kernels of captured steps, by name, per batch size.

    PYTHONPATH=. python3 bench/step_kernels.py --variant bf16 --layers 43 --batches 1,8,16 --out k.json

Builds the proxy (``bench/proxy.py``) behind an engine with decode slots, prefills ``--prompt-tokens`` random
tokens in each of ``batch`` sequences, replays the captured batched step a few times, then records
``--steps`` more under ``torch.profiler`` (CUPTI sees the kernels inside a graph replay). Prints, per batch,
the step's wall time, its kernel time and launches (a captured step pays a few microseconds a launch), and the
kernels summed by name (ms a step and launches a step), the largest first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from proxy import VARIANTS, build_proxy  # noqa: E402

from ds4serve import Engine  # noqa: E402
from ds4serve.tokenizer import Tokenizer  # noqa: E402


def kernel_table(prof: profile, steps: int) -> list[dict]:
    """Device kernels summed by name: ms and launches per step, the largest first."""
    total: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0:
            total[e.name] += e.device_time_total
            count[e.name] += 1
    rows = [
        {"kernel": k, "ms_per_step": v / 1e3 / steps, "launches_per_step": count[k] / steps}
        for k, v in total.items()
    ]
    return sorted(rows, key=lambda r: -r["ms_per_step"])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(engine: Engine, batch: int, prompt: int, steps: int, top: int) -> dict:
    """``batch`` prefilled sequences in decode slots: the timed replays and the profiled kernel table."""
    vocab = engine.cfg.vocab_size
    rng = torch.Generator().manual_seed(batch)
    states = [engine.acquire_state(prompt + 3 * steps + 8) for _ in range(batch)]
    for s in states:
        s.reset()
        engine.prefill(s, torch.randint(10, vocab, (prompt,), generator=rng).tolist())
    slots = [engine.enter_slot(s) for s in states]
    rows = torch.randint(10, vocab, (3 * steps, batch), generator=rng).tolist()
    times = []
    for row in rows[: 2 * steps]:
        _sync(engine.device)
        t0 = time.perf_counter()
        engine.decode_rows(slots, row)
        _sync(engine.device)
        times.append(time.perf_counter() - t0)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for row in rows[2 * steps :]:
            engine.decode_rows(slots, row)
        _sync(engine.device)
    table = kernel_table(prof, steps)
    for slot, state in reversed(list(zip(slots, states))):
        engine.leave_slot(slot, state, keep=False)
        engine.release_state(state)
    ms = 1e3 * statistics.median(times[2:])
    kernel_ms = sum(r["ms_per_step"] for r in table)
    launches = sum(r["launches_per_step"] for r in table)
    print(f"batch {batch}: {ms:.2f} ms/step, kernels {kernel_ms:.2f} ms/step in {launches:.0f} launches")
    for r in table[:top]:
        print(f"  {r['ms_per_step']:8.3f} ms {r['launches_per_step']:7.0f}x  {r['kernel'][:110]}")
    return {"batch": batch, "ms_per_step": ms, "launches_per_step": launches, "kernels": table}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--variant", default="bf16", choices=VARIANTS)
    p.add_argument("--layers", type=int, default=43)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--batches", default="1,8,16")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--top", type=int, default=14)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    model = build_proxy(args.variant, layers=args.layers, experts=args.experts, device=args.device)
    engine = Engine(
        model, Tokenizer(), max_context=args.prompt_tokens + 64 + 3 * args.steps, max_batch=max(batches)
    )
    with torch.inference_mode():
        engine.warm_up()
        runs = [measure(engine, b, args.prompt_tokens, args.steps, args.top) for b in batches]
    out = {
        "command": " ".join(sys.argv),
        "device": torch.cuda.get_device_name() if model.device.type == "cuda" else args.device,
        "runs": runs,
    }
    args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
