"""What structured output costs a decode token on the proxy model (needs llguidance; bench/run_all.sh installs a
carried wheel).

The proxy (bench/proxy.py, random weights) writes gibberish, so the grammars here allow any text: the mask is
computed and applied every token (llguidance's bitmask on the host, unpacked on the GPU) without ending the
answer early. Arms: no constraint, a grammar of any text, and a JSON schema of one string property (whose
string the random model never closes). Greedy decoding through the CUDA graph, ``--tokens`` tokens after a
``--prompt``-token prompt, each arm run twice (the first compiles and captures); of the second: the engine's
decode ms/token (``timings.decode_s``) and the median time between tokens as the caller receives them.

    PYTHONPATH=. python3 bench/constrained_gpu.py --out $OUT/constrained.json [--variant fp8] [--layers 43]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu import log  # noqa: E402
from proxy import VARIANTS, build_proxy  # noqa: E402

from ds4serve import Engine, SamplingParams  # noqa: E402
from ds4serve.tokenizer import Tokenizer  # noqa: E402

ARMS = {
    "free": {},
    "grammar: any text": {"grammar": "start: /(?s:.*)/"},
    "json_schema: one string": {
        "json_schema": {"type": "object", "required": ["s"], "properties": {"s": {"type": "string"}}}
    },
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--variant", default="fp8", choices=VARIANTS)
    p.add_argument("--layers", type=int, default=43)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--tokens", type=int, default=64)
    args = p.parse_args()
    engine = Engine(
        build_proxy(args.variant, layers=args.layers),
        Tokenizer(),
        max_context=args.prompt + args.tokens + 8,
        max_batch=1,
    )
    engine.warm_up()
    prompt = torch.randint(3, 128000, (args.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    out = {"device": torch.cuda.get_device_name(), "command": " ".join(sys.argv), "arms": {}}
    for name, extra in ARMS.items():
        params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True, **extra)
        for _ in range(2):
            stamps: list[float] = []
            res = engine.generate(prompt, params, on_token=lambda _: stamps.append(time.perf_counter()))
            if not res.ok:
                raise RuntimeError(f"{name}: {res.error_message}")
        ms = 1e3 * res.timings.decode_s / (len(res.tokens) - 1)
        between = 1e3 * statistics.median(b - a for a, b in zip(stamps, stamps[1:]))
        out["arms"][name] = {
            "ms_per_token": ms,
            "median_ms_between_tokens": between,
            "tokens": len(res.tokens),
            "prefill_ms": 1e3 * res.timings.prefill_s,
        }
        log(
            f"{args.variant} {args.layers} layers, {name}: {ms:.3f} ms/token ({between:.3f} between tokens) over "
            f"{len(res.tokens)} tokens; prefill {1e3 * res.timings.prefill_s:.1f} ms"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
