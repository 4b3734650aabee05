"""Speculative decoding on a trained checkpoint: what its MTP block and the n-gram drafter buy on code.

Prompts are the openings of held-out standard-library files (bench/stdlib_corpus.py), which the model
never trained on. For each prompt, plain decoding is timed, then each draft at a fixed width of 1..4 drafts
per step (``adaptive=False``, so every position is drafted every step): acceptance by draft position,
tokens per verify step, decode tokens/s and the speedup over plain decoding's (of the decode phase, and of
whole requests), for greedy requests (whose
tokens equal plain decoding's in float32; ``first_difference`` says where a bf16 run's first differ) and
sampled ones (temperature ``--temperature``, seeded).

    PYTHONPATH=. python3 bench/spec_trained.py --model DIR --out spec.json [--device cuda] [--prompts 4]
        [--prompt-len 128] [--tokens 64] [--widths 1,2,3,4] [--methods mtp,ngram]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from stdlib_corpus import heldout_documents  # noqa: E402

from ds4serve import Engine, SamplingParams  # noqa: E402
from ds4serve.engine.drafts import resolve_proposer  # noqa: E402
from ds4serve.engine.request import GenerateResult  # noqa: E402
from ds4serve.tokenizer import Tokenizer  # noqa: E402


def fixed_width(engine: Engine, method: str, k: int) -> object:
    """The engine's ``method`` proposer drafting exactly ``k`` tokens every step."""
    proposer = resolve_proposer(engine, f"{method}:{k}")
    proposer.adaptive = False
    return proposer


@dataclass
class Timed:
    """A request's result and its whole time, prompt to last token, as a client waits for it."""

    result: GenerateResult
    request_s: float


def run(engine: Engine, prompt: list[int], params: SamplingParams, speculative=None) -> Timed:
    start = time.perf_counter()
    result = engine.generate(prompt, params, speculative=speculative)
    if not result.ok:
        raise RuntimeError(result.error_message)
    return Timed(result, time.perf_counter() - start)


def summarize(timed: list[Timed], plain_timed: list[Timed]) -> dict:
    """Totals over the prompts: acceptance by draft position, tokens per verify step, decode tokens/s and
    speedup (decode seconds of plain decoding over this draft's, same tokens generated), and the speedup of
    whole requests (prefill and first token included)."""
    results, plain = [t.result for t in timed], [t.result for t in plain_timed]
    drafted_at = [0] * 16
    accepted_at = [0] * 16
    steps = emitted = 0
    for r in results:
        s = r.stats.speculative
        steps += s["steps"]
        emitted += s["emitted"]
        for i, rate in enumerate(s["acceptance_by_position"]):
            # steps that drafted position i: those verifying more than i + 1 tokens
            drafted = sum(count for width, count in s["verify_widths"].items() if int(width) > i + 1)
            drafted_at[i] += drafted
            accepted_at[i] += round(rate * drafted)
    used = [i for i, d in enumerate(drafted_at) if d]
    tokens = sum(len(r.tokens) for r in results)
    decode_s = sum(r.timings.decode_s for r in results)
    plain_s = sum(p.timings.decode_s for p in plain)
    return {
        "acceptance_by_position": [accepted_at[i] / drafted_at[i] for i in used],
        "tokens_per_step": emitted / max(steps, 1),
        "decode_tps": tokens / decode_s,
        "plain_decode_tps": sum(len(p.tokens) for p in plain) / plain_s,
        "speedup": plain_s / decode_s,
        "request_speedup": sum(t.request_s for t in plain_timed) / sum(t.request_s for t in timed),
        "same_tokens_as_plain": all(r.tokens == p.tokens for r, p in zip(results, plain)),
        "first_difference": [_first_difference(r.tokens, p.tokens) for r, p in zip(results, plain)],
    }


def _first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where the two token lists differ (None: equal)."""
    return next(
        (i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b))
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, type=Path)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--widths", default="1,2,3,4")
    p.add_argument("--methods", default="mtp,ngram")
    p.add_argument("--temperature", type=float, default=0.8)
    a = p.parse_args(argv)
    dtype = "bfloat16" if a.device.startswith("cuda") else "float32"
    engine = Engine.from_pretrained(a.model, device=a.device, dtype=dtype, max_batch=1)
    docs = [d for d in heldout_documents(Tokenizer(a.model)) if len(d) > a.prompt_len + a.tokens]
    prompts = [d[: a.prompt_len] for d in docs[: a.prompts]]
    modes = {
        "greedy": lambda i: SamplingParams(max_tokens=a.tokens, ignore_eos=True),
        "sampled": lambda i: SamplingParams(
            max_tokens=a.tokens, temperature=a.temperature, seed=i, ignore_eos=True
        ),
    }
    engine.warm_up()
    out: dict = {"model": str(a.model), "device": a.device, "dtype": dtype, "prompts": len(prompts)}
    out.update({"prompt_len": a.prompt_len, "tokens": a.tokens, "runs": []})
    for mode, params in modes.items():
        for method in a.methods.split(","):
            for k in map(int, a.widths.split(",")):
                # untimed: the first runs of a width compile and capture the draft passes of each row and draft
                # count it meets (a server captures each once); every prompt, so the timed runs meet none anew
                for i, q in enumerate(prompts):
                    run(engine, q, params(i), fixed_width(engine, method, k))
                plain, results = [], []
                for i, q in enumerate(prompts):  # interleaved, so that both see the same machine
                    plain.append(run(engine, q, params(i)))
                    results.append(run(engine, q, params(i), fixed_width(engine, method, k)))
                row = {"method": method, "drafts": k, "mode": mode, **summarize(results, plain)}
                if mode != "greedy":  # sampled: the same distribution, not the same tokens
                    del row["same_tokens_as_plain"], row["first_difference"]
                out["runs"].append(row)
                print(json.dumps(row), flush=True)
    a.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
