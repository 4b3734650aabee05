"""Load on the real HTTP server, the engine's own batched decode step, and the step's roofline, in one run.

*Served*: the server as ``ds4serve serve`` builds it (uvicorn on loopback, in this process, with its prefix
cache) under C concurrent clients. Each client sends ``--requests-per-client`` streamed chat requests one after
the other (``ignore_eos``, ``max_tokens`` = ``--output-tokens``, usage in the stream), greedy or sampled (0.8,
a seed per request). Every prompt is a user message of about ``--prompt-tokens`` tokens (counted with the
engine's tokenizer through the chat template) that starts with a tag no other request of the run has, so the
prefix cache shares nothing but the template's first tokens. A level stops issuing requests after
``--time-limit`` seconds and cancels what is still running ``--drain`` seconds later (counted as unfinished).
Per (mode, concurrency, prompt length): aggregate output tok/s (the finished requests' usage tokens over the
level's wall time), time to first token and inter-chunk latency p50 / p99 / max, requests, errors (a non-200
answer or an error event), unfinished. With several ``--max-prefill-tokens`` the served levels run under each
budget in turn (set on the engine between levels).

*Engine*: B sequences (B = min(C, ``--max-batch``)) prefilled with ``--prompt-tokens`` random ids, entered into
decode slots, then ``--steps`` timed ``Engine.decode_rows`` steps on random tokens (the median of all but the
first two).

*Roofline*: the bytes one such step must read: every weight but the routed experts and the embedding table
once, one embedding row per sequence, in each layer the routed experts the step's rows chose (observed on an
eager step over the same slots) and each sequence's KV state up to its position (its snapshot's size); over
the same run's device copy bandwidth (bytes read plus written a second). ``tiled_bytes`` is what the batched
step reads as written: each tile of ``ROW_TILE`` rows reads the token-wise weights again; the routed experts
count once a step (every real row's pairs run in one launch, those sharing an expert reading it close together).

    PYTHONPATH=. python3 bench/serve_load.py --model proxy --variant bf16 --layers 43 \\
        --concurrency 1,4,16 --prompt-tokens 512 --time-limit 25 --drain 40 --out $OUT/load.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Iterator

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from load_client import MODES, request_body, run_level, summarize  # noqa: E402
from proxy import VARIANTS, build_proxy  # noqa: E402
from serve_gpu import served_url  # noqa: E402

from ds4serve import Engine  # noqa: E402
from ds4serve.cli import default_model_dir  # noqa: E402
from ds4serve.model import batch as batch_module  # noqa: E402
from ds4serve.model.batch import ROW_TILE  # noqa: E402
from ds4serve.model.deepseek4 import DeepSeekV4, _tensors_of  # noqa: E402
from ds4serve.server.chat_format import encode_messages  # noqa: E402
from ds4serve.state import SequenceState  # noqa: E402
from ds4serve.tokenizer import Tokenizer  # noqa: E402

WARM_STEPS = 2  # engine steps left out of the median
WORDS = (
    "river stone market window garden lantern copper silver morning evening harbor valley mountain letter "
    "engine number quiet bright yellow purple winter summer autumn spring forest meadow kettle bridge tower "
    "island signal pocket circle ladder candle mirror thunder velvet marble orchard compass shelter canvas"
).split()


def log(msg: str) -> None:
    print(msg, flush=True)


# ---- prompts --------------------------------------------------------------------------------------------


def chat_tokens(tokenizer: Tokenizer, text: str) -> int:
    """Prompt tokens of one user message ``text`` as the server encodes a chat request (chat mode)."""
    encoded = encode_messages([{"role": "user", "content": text}], thinking=False)
    return len(encoded.token_ids(tokenizer))


def tag(n: int) -> str:
    """The run-unique head of request ``n``'s message (fixed width, so every prompt has about one length)."""
    return f"[request {n:06d}] "


def prompt_body(tokenizer: Tokenizer, target: int, seed: int) -> str:
    """Random words such that ``tag(n) + body`` is ``target`` chat tokens give or take a few (raises ValueError
    when ``target`` is shorter than the template and the tag)."""
    rng = random.Random(seed)
    words: list[str] = []
    for _ in range(12):
        have = chat_tokens(tokenizer, tag(0) + " ".join(words))
        if have == target:
            break
        if have > target:
            if not words:
                raise ValueError(
                    f"prompt_tokens: {target} is shorter than the chat template and tag ({have})"
                )
            del words[max(0, len(words) - (have - target)) :]
        else:
            words += [rng.choice(WORDS) for _ in range(target - have)]
    return " ".join(words)


# ---- served load ----------------------------------------------------------------------------------------


class Tags:
    """Request numbers unique over the whole run (so no two prompts share more than the template's head)."""

    def __init__(self) -> None:
        self.next = 0

    def take(self) -> int:
        self.next += 1
        return self.next - 1


def served_level(
    url: str,
    tokenizer: Tokenizer,
    body_text: str,
    tags: Tags,
    *,
    mode: str,
    concurrency: int,
    requests_per_client: int,
    output_tokens: int,
    time_limit: float,
    drain: float,
    seed: int,
) -> dict:
    """One level: ``concurrency`` clients of ``requests_per_client`` requests each (prompts built and counted
    before the clock starts), summarised by :func:`summarize` with the prompts' measured lengths."""
    bodies, lengths = [], []
    for _ in range(concurrency):
        mine = []
        for _ in range(requests_per_client):
            n = tags.take()
            text = tag(n) + body_text
            lengths.append(chat_tokens(tokenizer, text))
            mine.append(request_body(text, mode, output_tokens, seed + n))
        bodies.append(mine)
    records, wall = run_level(url, bodies, time_limit, drain)
    return {
        "mode": mode,
        "concurrency": concurrency,
        "prompt_tokens_measured": [min(lengths), max(lengths)],
        **summarize(records, wall),
    }


def serving(engine: Engine, max_queue: int) -> contextlib.AbstractContextManager[str]:
    """The server (:func:`serve_gpu.served_url`) admitting ``max_queue`` waiting requests, so a level's clients
    queue rather than get 429; yields its base URL."""
    return served_url(engine, max_queue=max_queue)


def wait_idle(engine: Engine, timeout: float) -> bool:
    """Wait until ``engine`` runs and queues nothing (cancelled requests of a level withdrawn), at most
    ``timeout`` seconds; returns whether it is idle."""
    end = time.monotonic() + timeout
    while not engine.idle and time.monotonic() < end:
        time.sleep(0.05)
    return engine.idle


# ---- engine steps and roofline --------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int, reps: int = 5) -> float:
    """Bytes a second that ``Tensor.copy_`` of ``nbytes`` moves on ``device``, read plus written (the best of
    ``reps`` after one untimed copy): CUDA events on CUDA, ``perf_counter`` elsewhere."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = math.inf
    for _ in range(reps):
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            seconds = begin.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            seconds = time.perf_counter() - t0
        best = min(best, seconds)
    return 2 * src.numel() * src.element_size() / best


@contextlib.contextmanager
def routed_experts_seen() -> Iterator[dict[int, list[set[int]]]]:
    """While active, each expert call of a batched decode step records the routed experts each tile's real
    rows chose: ``{id(MoEWeights): [one set per tile, in call order]}``. Nothing a CUDA-graph replay does is
    seen, only eager steps."""
    original = batch_module.batch_experts
    seen: dict[int, list[set[int]]] = {}

    def observed(w, tiles, limit, real, slot_terms=False):  # noqa: ANN001
        for t, (x, _, idx) in enumerate(tiles):
            rows = min(x.shape[0], real - t * x.shape[0])
            seen.setdefault(id(w), []).append(set(idx[:rows].flatten().tolist()))
        return original(w, tiles, limit, real, slot_terms=slot_terms)

    batch_module.batch_experts = observed
    try:
        yield seen
    finally:
        batch_module.batch_experts = original


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def weight_bytes(model: DeepSeekV4) -> dict:
    """What a decode step's weights weigh: ``once`` (read once a step: the head and every block's tensors but
    the routed experts and hash tables), ``embed_row`` (one token's embedding row), ``expert`` (by layer: one
    routed expert's w1, w3 and w2 with their scales)."""
    once = _nbytes(_tensors_of(model.head)) if model.head is not None else 0
    expert = {}
    for i, b in model.blocks.items():
        m = b.moe
        routed = _nbytes(_tensors_of(m.w1) + _tensors_of(m.w3) + _tensors_of(m.w2))
        expert[i] = routed // model.cfg.n_routed_experts
        rest = dataclasses.replace(m, w1=None, w3=None, w2=None, tid2eid=None)
        once += _nbytes(_tensors_of(rest)) + _nbytes(_tensors_of(dataclasses.replace(b, moe=None)))
    embed_row = model.embed[0].numel() * model.embed.element_size() if model.embed is not None else 0
    return {"once": once, "embed_row": embed_row, "expert": expert}


def kv_bytes(state: SequenceState) -> int:
    """The KV state a decode step of ``state``'s sequence reads: its window ring and compressor entries and
    buffers up to its position (the size of its right-sized snapshot, logits left out)."""
    snap = state.snapshot()
    logits = 0 if snap.last_logits is None else snap.last_logits.numel() * snap.last_logits.element_size()
    return snap.nbytes() - logits


@dataclasses.dataclass
class ExpertCounts:
    """Routed experts one decode step reads, by layer: ``distinct`` over the whole step; the step's ``tiles``;
    ``source``: "observed" or "bound" (min(E, rows * top_k))."""

    distinct: dict[int, int]
    tiles: int
    source: str


def observed_counts(model: DeepSeekV4, seen: dict[int, list[set[int]]]) -> ExpertCounts:
    """The counts of ``seen`` (from :func:`routed_experts_seen` over one step of ``model``)."""
    by_layer = {id(b.moe): i for i, b in model.blocks.items()}
    return ExpertCounts(
        distinct={by_layer[k]: len(set().union(*tiles)) for k, tiles in seen.items()},
        tiles=max((len(t) for t in seen.values()), default=1),
        source="observed",
    )


def bound_counts(model: DeepSeekV4, batch: int) -> ExpertCounts:
    """At most min(E, rows * top_k) experts a layer: over the step's ``batch`` rows, and over each tile's."""
    E, k = model.cfg.n_routed_experts, model.cfg.top_k
    tile_rows = [min(ROW_TILE, batch - start) for start in range(0, batch, ROW_TILE)]
    return ExpertCounts(
        distinct={i: min(E, batch * k) for i in model.blocks},
        tiles=len(tile_rows),
        source="bound",
    )


def step_roofline(model: DeepSeekV4, counts: ExpertCounts, batch: int, kv: int, bandwidth: float) -> dict:
    """The bytes of one decode step of ``batch`` rows reading ``counts``' experts and ``kv`` KV bytes (the
    rows' together), and the tok/s reading them at ``bandwidth`` allows. ``bytes`` reads each weight once a
    step; ``tiled_bytes`` as the batched step runs: the token-wise weights once per tile, the routed experts
    once a step."""
    w = weight_bytes(model)
    rows = batch * w["embed_row"] + kv
    total = w["once"] + rows + sum(n * w["expert"][i] for i, n in counts.distinct.items())
    tiled = counts.tiles * w["once"] + rows + sum(n * w["expert"][i] for i, n in counts.distinct.items())
    return {
        "bytes": total,
        "tiled_bytes": tiled,
        "tiles": counts.tiles,
        "weight_once_bytes": w["once"],
        "kv_bytes": kv,
        "experts_source": counts.source,
        "experts_distinct_mean": statistics.mean(counts.distinct.values()) if counts.distinct else 0.0,
        "experts_bound": min(model.cfg.n_routed_experts, batch * model.cfg.top_k),
        "roofline_ms": 1e3 * total / bandwidth,
        "roofline_tok_s": batch * bandwidth / total,
    }


def expert_counts(model: DeepSeekV4, slots: list[SequenceState], tokens: list[int]) -> ExpertCounts:
    """The experts an eager step of ``tokens`` over ``slots`` chooses (nothing committed); where that step
    fails, the bound, with the failure logged (the run goes on)."""
    try:
        with routed_experts_seen() as seen:
            model.decode_batch(tokens, slots)
        return observed_counts(model, seen)
    except Exception as exc:  # noqa: BLE001 (one device call must not be lost to the roofline's observer)
        log(f"routing not observed ({type(exc).__name__}: {exc}); the roofline uses the bound")
        return bound_counts(model, len(slots))


def engine_steps(
    engine: Engine, batch: int, prompt_tokens: int, steps: int, bandwidth: float, seed: int
) -> dict:
    """``batch`` sequences prefilled with ``prompt_tokens`` random ids, ``steps`` timed ``decode_rows`` steps
    on random tokens through decode slots (ms: the median after :data:`WARM_STEPS`), one more eager step
    observed for the roofline (its results not committed); every state released after."""
    if steps <= WARM_STEPS:
        raise ValueError(f"steps: expected more than {WARM_STEPS}, got {steps}")
    model = engine.require_model()
    rng = torch.Generator().manual_seed(seed)
    vocab = engine.cfg.vocab_size
    tokens = torch.randint(10, vocab, (steps + 1, batch), generator=rng).tolist()
    with torch.inference_mode():
        states = [engine.acquire_state(prompt_tokens + steps + 1) for _ in range(batch)]
        for state in states:
            state.reset()
            engine.prefill(state, torch.randint(10, vocab, (prompt_tokens,), generator=rng).tolist())
        kv = sum(kv_bytes(s) for s in states)
        slots = [engine.enter_slot(state) for state in states]
        times = []
        for row in tokens[:steps]:
            _sync(engine.device)
            t0 = time.perf_counter()
            engine.decode_rows(slots, row)
            _sync(engine.device)
            times.append(time.perf_counter() - t0)
        counts = expert_counts(model, slots, tokens[steps])
        for slot, state in reversed(list(zip(slots, states))):
            engine.leave_slot(slot, state)
            engine.release_state(state)
    ms = 1e3 * statistics.median(times[WARM_STEPS:])
    roof = step_roofline(model, counts, batch, kv, bandwidth)
    return {
        "batch": batch,
        "prompt_tokens": prompt_tokens,
        "ms_per_step": ms,
        "tok_s": 1e3 * batch / ms,
        **roof,
        "fraction_of_roofline": roof["roofline_ms"] / ms,
    }


# ---- the run --------------------------------------------------------------------------------------------


def load_engine(args: argparse.Namespace) -> Engine:
    """The engine of ``--model``: the proxy (made on ``--device``) or the built-in tiny checkpoint."""
    if args.model == "proxy":
        model = build_proxy(args.variant, layers=args.layers, experts=args.experts, device=args.device)
        tokenizer = Tokenizer()
        return Engine(model, tokenizer, max_context=args.max_context, **_limits(args))
    return Engine.from_pretrained(
        default_model_dir(), device=args.device, max_context=args.max_context, **_limits(args)
    )


def _limits(args: argparse.Namespace) -> dict:
    return {"max_batch": args.max_batch}


def run(engine: Engine, args: argparse.Namespace, out: dict, save) -> dict:  # noqa: ANN001
    """Every level of ``args`` on ``engine``: the copy bandwidth, the engine steps of each (prompt length,
    batch), then the served levels of each (mode, prompt length, concurrency), each served level joined with
    the engine step of its batch. Fills ``out`` and calls ``save()`` after each level; returns ``out``."""
    need = max(args.prompt_tokens) + args.output_tokens + 64
    if need > engine.max_context:
        raise ValueError(
            f"max_context: {engine.max_context} is short of {need} (longest prompt + output + 64)"
        )
    bandwidth = copy_bandwidth(engine.device, args.copy_mib << 20)
    out["copy_gb_s"] = bandwidth / 1e9
    log(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + written)")
    batches = sorted({min(c, args.max_batch) for c in args.concurrency})
    steps = out.setdefault("engine_steps", [])
    for length in args.prompt_tokens:
        for b in batches:
            rec = engine_steps(engine, b, length, args.steps, bandwidth, args.seed)
            steps.append(rec)
            save()
            log(
                f"engine batch {b} prompt {length}: {rec['ms_per_step']:.2f} ms/step, {rec['tok_s']:.0f} tok/s,"
                f" roofline {rec['roofline_tok_s']:.0f} tok/s ({100 * rec['fraction_of_roofline']:.0f}%),"
                f" experts/layer {rec['experts_distinct_mean']:.1f} (bound {rec['experts_bound']})"
            )
    by_key = {(r["prompt_tokens"], r["batch"]): r for r in steps}
    served = out.setdefault("served", [])
    tags = Tags()
    budgets = args.max_prefill_tokens or [engine.max_prefill_tokens]
    with serving(engine, max_queue=max(args.concurrency)) as url:
        for budget, mode, length in itertools.product(budgets, args.modes, args.prompt_tokens):
            engine.max_prefill_tokens = budget
            text = prompt_body(engine.tokenizer, length, args.seed)
            for c in args.concurrency:
                rec = served_level(
                    url, engine.tokenizer, text, tags, mode=mode, concurrency=c,
                    requests_per_client=args.requests_per_client, output_tokens=args.output_tokens,
                    time_limit=args.time_limit, drain=args.drain, seed=args.seed,
                )  # fmt: skip
                step = by_key[(length, min(c, args.max_batch))]
                rec = {
                    "prompt_tokens": length,
                    "max_prefill_tokens": budget,
                    **rec,
                    "engine_batch": step["batch"],
                    "engine_tok_s": step["tok_s"],
                    "roofline_tok_s": step["roofline_tok_s"],
                    "served_over_engine": rec["aggregate_tok_s"] / step["tok_s"],
                }
                rec["idle_after"] = wait_idle(engine, args.drain)
                served.append(rec)
                save()
                log(_served_line(rec))
    return out


def _served_line(rec: dict) -> str:
    def f(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}"

    return (
        f"served {rec['mode']} concurrency {rec['concurrency']} prompt {rec['prompt_tokens']} "
        f"prefill budget {rec['max_prefill_tokens']}: "
        f"{rec['aggregate_tok_s']:.1f} tok/s ({100 * rec['served_over_engine']:.0f}% of the engine's), "
        f"ttft p50 {f(rec['ttft_ms_p50'])} p99 {f(rec['ttft_ms_p99'])} max {f(rec['ttft_ms_max'])} ms, "
        f"itl p50 {f(rec['itl_ms_p50'])} p99 {f(rec['itl_ms_p99'])} max {f(rec['itl_ms_max'])} ms, "
        f"requests {rec['requests']} "
        f"(ok {rec['ok']}, errors {rec['errors']}, unfinished {rec['unfinished']})"
    )


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", choices=("proxy", "tiny"), default="proxy")
    p.add_argument("--variant", default="bf16", choices=VARIANTS)
    p.add_argument("--layers", type=int, default=43)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument(
        "--max-prefill-tokens",
        type=_ints,
        default=[],
        help="prompt tokens a step forwards, comma-separated: the served levels run under each (default: the "
        "engine's)",
    )
    p.add_argument("--max-context", type=int, default=4096)
    p.add_argument("--concurrency", type=_ints, default=[1, 4, 16])
    p.add_argument("--prompt-tokens", type=_ints, default=[512])
    p.add_argument("--output-tokens", type=int, default=256)
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument(
        "--modes",
        type=lambda s: [m for m in s.split(",") if m],
        default=list(MODES),
        help='served modes, comma-separated ("": the engine steps alone)',
    )
    p.add_argument("--time-limit", type=float, default=25.0, help="seconds a level issues requests")
    p.add_argument("--drain", type=float, default=40.0, help="seconds after the limit before cancelling")
    p.add_argument("--steps", type=int, default=16, help="timed engine decode steps per batch")
    p.add_argument("--copy-mib", type=int, default=1024, help="size of the timed bandwidth copy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-warm-up", action="store_true", help="skip Engine.warm_up (CPU smoke runs)")
    return p


def main() -> None:
    args = parser().parse_args()
    unknown = set(args.modes) - set(MODES)
    if unknown:
        raise SystemExit(f"--modes: unknown {sorted(unknown)}; expected among {list(MODES)}")
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else args.device
    out: dict = {"device": name, "command": " ".join(sys.argv), "args": {**vars(args), "out": str(args.out)}}
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        args.out.write_text(json.dumps(out, indent=1) + "\n")

    engine = load_engine(args)
    if not args.no_warm_up:
        log(f"warm-up {engine.warm_up():.1f} s")
    run(engine, args, out, save)
    save()


if __name__ == "__main__":
    main()
