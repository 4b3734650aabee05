"""Speculative decoding on one GPU: greedy tokens/s at chosen verify widths and acceptance rates.

The proxy (bench/proxy.py: random weights, no MTP block) has no real draft, so the drafts come from
:class:`~ds4serve.engine.drafts.OracleProposer`: it knows the continuation the verify path emits
at that width (:func:`verifier_sequence`) and gets each draft right with probability ``p``. For every
width and ``p`` the same prompt is generated through the verify graphs (mode ``graphs``) or an eager engine
(``eager``: every step eager), against plain decoding (CUDA-graph decode): tokens/s, tokens per verify
step, and whether the tokens equal plain decoding's (in bf16 on random weights they need not: near-tied
greedy choices flip with the rounding; the exact check is check_gpu.py's float32 one).
``--model DIR`` runs a checkpoint instead of the proxy (and adds its MTP draft, if any). ``--predictions`` adds
OpenAI's predicted outputs (:class:`~ds4serve.engine.drafts.PredictionProposer`, up to 8 drafts a step): a prediction
equal to the continuation the verify path emits at width 9, and the same with 4 of its tokens cut and 4 replaced.

    PYTHONPATH=. python3 bench/spec_gpu.py --out $OUT/spec.json [--variant bf16] [--widths 2,3,4,6]
        [--accept 0.5,0.9] [--prompt 512] [--tokens 64] [--modes graphs,eager] [--predictions]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu import log  # noqa: E402
from proxy import build_proxy  # noqa: E402

from ds4serve import Engine, SamplingParams  # noqa: E402
from ds4serve.engine.drafts import OracleProposer, PredictionProposer  # noqa: E402
from ds4serve.tokenizer import Tokenizer  # noqa: E402

MODES = {"graphs": False, "eager": True}  # mode -> the engine's eager flag


def timed(engine: Engine, prompt: list[int], params: SamplingParams, speculative=None):
    """The result of one generation and its decode tokens/s (prefill excluded; the engine returns
    after its last token reached the host, so no device work is pending)."""
    result = engine.generate(prompt, params, speculative=speculative)
    if not result.ok:
        raise RuntimeError(result.error_message)
    return result, (len(result.tokens) - 1) / result.timings.decode_s


def verifier_sequence(
    engine: Engine, prompt: list[int], params: SamplingParams, width: int, tokens: list[int], rounds: int = 3
) -> tuple[list[int], int]:
    """The continuation the verify path itself emits at ``width``, for the oracle to draft from.

    In bf16 a verify block rounds differently from a decode step (other kernel shapes), and on random
    weights the greedy choice is a near tie, so the plain greedy continuation ``tokens`` and the
    verified one part within a few tokens; an oracle drafting plain's tokens is then wrong at every
    later position. Generate with a perfect oracle at this width and draft from what it emitted,
    until a run reproduces its drafts (at most ``rounds`` runs). Returns prompt + continuation and
    the runs taken (``rounds`` + 1 when no run reproduced)."""
    for run in range(1, rounds + 1):
        result, _ = timed(engine, prompt, params, OracleProposer(prompt + tokens, 1.0, width))
        if result.tokens == tokens:
            return prompt + tokens, run
        tokens = result.tokens
    return prompt + tokens, rounds + 1


def prediction_drafts(engine: Engine, prompt: list[int], params: SamplingParams, tokens: list[int]) -> list:
    """``(name, make proposer)`` of two predicted outputs: the verify path's own continuation at the widest
    block a prediction drafts (9 rows), and that continuation with tokens 16-19 cut and 40-43 replaced."""
    known, runs = verifier_sequence(
        engine, prompt, params, PredictionProposer([]).max_draft_tokens + 1, tokens
    )
    log(f"prediction: the verify path's own continuation after {runs} run(s)")
    answer = known[len(prompt) :]
    edited = (
        answer[:16] + answer[20:40] + [(t + 1) % engine.cfg.vocab_size for t in answer[40:44]] + answer[44:]
    )
    return [
        ("prediction exact", lambda: PredictionProposer(answer)),
        ("prediction 4 cut, 4 replaced", lambda: PredictionProposer(edited)),
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", type=Path, default=None, help="a checkpoint instead of the proxy")
    p.add_argument("--device", default="cuda", help="cpu runs a --model checkpoint in float32 (a smoke test)")
    p.add_argument("--variant", default="bf16", help="proxy weights: bf16, fp8, fp8+fp4")
    p.add_argument("--layers", type=int, default=43)
    p.add_argument("--widths", default="2,3,4,6")
    p.add_argument("--accept", default="0.5,0.9")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--modes", default="graphs", help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--predictions", action="store_true", help="also time predicted outputs, exact and edited")
    args = p.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    accepts = [float(a) for a in args.accept.split(",")]
    modes = args.modes.split(",")
    if set(modes) - set(MODES):
        raise SystemExit(f"--modes: expected some of {list(MODES)}, got {modes}")
    context = args.prompt + args.tokens + 64
    if args.model is not None:
        dtype = "bfloat16" if args.device != "cpu" else "float32"
        engine = Engine.from_pretrained(
            args.model, device=args.device, dtype=dtype, max_context=context, max_batch=1
        )
    else:
        engine = Engine(
            build_proxy(args.variant, layers=args.layers),
            Tokenizer(),
            max_context=context,
            chunk_size=2048,
            max_batch=1,
        )
    prompt = torch.randint(3, 128000, (args.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    timed(engine, prompt, params)  # compiles and captures the decode graph
    plain, plain_tps = timed(engine, prompt, params)
    log(f"plain decoding: {plain_tps:.1f} tok/s")
    device = torch.cuda.get_device_name() if args.device != "cpu" else "cpu"
    out = {
        "device": device,
        "command": " ".join(sys.argv),
        "model": str(args.model or f"proxy {args.variant} {args.layers} layers"),
        "plain_tokens_per_s": plain_tps,
        "runs": [],
    }
    for mode in modes:
        engine.eager = MODES[mode]
        drafts = []
        for w in widths:
            known, runs = verifier_sequence(engine, prompt, params, w, plain.tokens)
            log(f"{mode:>6} width {w}: the verify path's own continuation after {runs} run(s)")
            drafts += [
                (f"oracle width {w} p {a}", lambda known=known, w=w, a=a: OracleProposer(known, a, w))
                for a in accepts
            ]
        if args.predictions:
            drafts += prediction_drafts(engine, prompt, params, plain.tokens)
        if args.model is not None and engine.cfg.n_mtp_layers:
            drafts.append(("mtp", lambda: "mtp"))
        for name, make in drafts:
            t0 = time.perf_counter()
            timed(engine, prompt, params, make())  # compiles and captures this width's graphs
            first_s = time.perf_counter() - t0
            res, tps = timed(engine, prompt, params, make())
            spec = res.stats.speculative
            row = {
                "mode": mode,
                "draft": name,
                "tokens_per_s": tps,
                "speedup": tps / plain_tps,
                "tokens_per_verify": spec["tokens_per_forward"],
                "acceptance": spec["acceptance_rate"],
                "equal_to_plain": res.tokens == plain.tokens,
                "first_run_s": first_s,
            }
            out["runs"].append(row)
            log(
                f"{mode:>6} {name}: {tps:.1f} tok/s ({row['speedup']:.2f}x plain), "
                f"{row['tokens_per_verify']:.2f} tokens/verify, equal to plain: {row['equal_to_plain']}, "
                f"first run {first_s:.1f} s"
            )
    engine.eager = False
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
