"""One speculative request on the built-in model, timed and profiled: where a verify step's time goes.

Decodes the first 128 tokens of a held-out standard-library file with plain decoding and with MTP at fixed
widths 1..3 (``--reps`` rounds over the widths in turn, so that a slow spell of the host hits every width alike;
the fastest and the median run are reported), then, unless ``--no-profile``, profiles one plain and
one width-1 request with cProfile (host functions) and, on a GPU, torch.profiler (host calls such as
``cudaMemcpyAsync`` and ``cudaGraphLaunch`` against device kernels); ``--trace FILE`` writes torch.profiler's
Chrome trace of a width-1 request of ``--trace-tokens`` tokens (host calls and kernels on one timeline, to see
where the device waits for the host). Run it in two checkouts in one device call to compare two commits.

    PYTHONPATH=. python3 bench/spec_step.py [--tokens 128] [--reps 5] [--no-profile] [--trace FILE]
"""

from __future__ import annotations

import argparse
import cProfile
import io
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
    p.add_argument("--trace", type=Path, default=None, help="Chrome trace of one width-1 request (GPU only)")
    p.add_argument("--trace-tokens", type=int, default=32)
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

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
            generate(1, a.trace_tokens)
        tp.export_chrome_trace(str(a.trace))
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


if __name__ == "__main__":
    raise SystemExit(main())
