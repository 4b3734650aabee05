"""Decode speed on the CPU: the built-in model (or ``--model DIR``) in float32 through ``Engine``, a lone greedy
request and ``--concurrency`` requests stepped together, plain and with each ``--speculative`` method.

    PYTHONPATH=. python3 bench/cpu_decode.py --tokens 48 --concurrency 8 --speculative mtp:1,mtp:3

Prints one line a measurement: the best of ``--reps`` runs after an untimed one (whole requests: a prompt of
60 tokens prefilled, then ``--tokens`` decoded), and checks that every run gave the lone plain run's tokens.
"""

from __future__ import annotations

import argparse
import time

import torch

from ds4serve.cli import default_model_dir
from ds4serve.engine import Engine
from ds4serve.engine.request import SamplingParams

PROMPT = list(range(100, 160))


def best_of(reps: int, run) -> tuple[float, object]:
    run()
    times, out = [], None
    for _ in range(reps):
        start = time.perf_counter()
        out = run()
        times.append(time.perf_counter() - start)
    return min(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the built-in model)")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--speculative", default="", help="comma-separated methods, e.g. mtp:1,ngram:4")
    ap.add_argument("--max-batch", type=int, default=None)
    ap.add_argument("--reps", type=int, default=2)
    a = ap.parse_args()
    engine = Engine.from_pretrained(
        a.model or default_model_dir(), device="cpu", dtype=torch.float32, max_batch=a.max_batch
    )
    params = SamplingParams(max_tokens=a.tokens, temperature=0, ignore_eos=True)
    print(f"threads {torch.get_num_threads()}, max_batch {engine.max_batch}")
    want = None
    for spec in [None] + [s for s in a.speculative.split(",") if s]:
        seconds, result = best_of(a.reps, lambda: engine.generate(PROMPT, params, speculative=spec))
        want = want or result.tokens
        same = "same tokens" if result.tokens == want else "DIFFERENT tokens"
        print(f"lone {spec or 'plain'}: {seconds * 1000:.0f} ms ({a.tokens / seconds:.1f} tok/s), {same}")

    def together() -> list:
        handles = [engine.stream(PROMPT, params) for _ in range(a.concurrency)]
        while not all(h.done for h in handles):
            engine.step()
        return [h.result.tokens for h in handles]

    seconds, tokens = best_of(a.reps, together)
    same = "same tokens" if all(t == want for t in tokens) else "DIFFERENT tokens"
    print(
        f"{a.concurrency} together, plain: {seconds * 1000:.0f} ms "
        f"({a.concurrency * a.tokens / seconds:.1f} tok/s in all), {same}"
    )


if __name__ == "__main__":
    main()
