"""Lightning indexer of the CSA layers: the torch path (fp32 matmul + topk) against the kernels.

Decode rows (S=1, ih=64, dim=128, k=512) over entry buffers of 2048, 8192, 32768 and 262144 rows (8K,
32K, 128K and 1M context) with 128 or all entries visible, each path captured 20 times in a CUDA graph so that
the time per call is GPU time as inside the decode graph; then the kernel configurations of the
scores and the selection separately. Prefill: a 2048-row chunk over 2048 entries (causal), the
torch path against the scores kernel with the select kernel or with torch.topk, and the kernels over
32768 entries (the last chunk of a 131,072-token prompt). Agreement: the
selected sets of both paths per row (they can differ only where two scores are within the
kernels' rounding of each other), and the select kernel against torch.topk on the same scores.
Usage (GPU machine, repository root; about 30 s)::

    PYTHONPATH=. python3 bench/sweep_indexer.py --out $OUT/indexer.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable

import torch

from ds4serve import kernels
from ds4serve.kernels.indexer import (
    ScoresConfig,
    SelectConfig,
    default_scores_config,
    index_scores,
    select_top,
)
from ds4serve.model.attention import _index_top
from ds4serve.model.rope import Rope

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu import cuda_ms  # noqa: E402

IH, DIM, ROPE, K = 64, 128, 64, 512
SCORES_DECODE = [
    ScoresConfig(1, 16),
    ScoresConfig(1, 32),
    ScoresConfig(1, 64),
    ScoresConfig(1, 128),
    ScoresConfig(1, 128, 8),
    ScoresConfig(1, 256, 8),
]
SCORES_PREFILL = [
    ScoresConfig(4, 64),
    ScoresConfig(8, 64),
    ScoresConfig(16, 64),
    ScoresConfig(8, 128, 8),
    ScoresConfig(16, 128, 8),
    ScoresConfig(32, 128, 8),
]
SELECTS = [
    SelectConfig(),
    SelectConfig(tile=1024),
    SelectConfig(tile=2048),
    SelectConfig(tile=8192, warps=16),
    SelectConfig(split_bits=4),
    SelectConfig(bits=8),
]
# entries up to which a prefill chunk also runs the torch path (fp32 [S, ih, T] scores)
TORCH_PREFILL_MAX = 8192
RESULTS: list[dict] = []


def record(**row) -> None:
    RESULTS.append(row)
    print(
        " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True
    )


def graph_us(fn: Callable[[], object], calls: int = 20, replays: int = 5) -> float:
    """GPU microseconds per call of ``fn``, captured ``calls`` times in one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(replays):
        graph.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1000 / (calls * replays)


def inputs(S: int, T: int, visible: torch.Tensor) -> dict:
    return dict(
        q=torch.randn(S, IH, DIM, device="cuda", dtype=torch.bfloat16),
        cos=torch.rand(S, ROPE // 2, device="cuda", dtype=torch.bfloat16),
        sin=torch.rand(S, ROPE // 2, device="cuda", dtype=torch.bfloat16),
        keys=torch.randn(T, DIM, device="cuda", dtype=torch.bfloat16),
        head_w=torch.randn(S, IH, device="cuda", dtype=torch.bfloat16),
        visible=visible,
        k=K,
    )


def torch_path(a: dict) -> torch.Tensor:
    with kernels.disabled():
        return _index_top.eager(**a)


def kernel_path(a: dict) -> torch.Tensor:
    return _index_top.eager(**a)


def topk_select(scores: torch.Tensor, k: int) -> torch.Tensor:
    top = scores.topk(k, dim=-1).indices
    return torch.zeros(scores.shape, dtype=torch.bool, device=scores.device).scatter_(-1, top, True) & (
        scores > float("-inf")
    )


def agreement(got: torch.Tensor, want: torch.Tensor) -> dict:
    return {
        "rows_equal": int((got == want).all(dim=-1).sum()),
        "rows": got.shape[0],
        "entries_differing": int((got != want).sum()),
    }


def roped(a: dict) -> torch.Tensor:
    return Rope.apply(a["q"], a["cos"], a["sin"])


def scores_err(q: torch.Tensor, a: dict, scores: torch.Tensor) -> float:
    """Max |kernel - torch fp32| over the visible scores, relative to their largest magnitude."""
    ref = torch.relu(torch.matmul(q.float(), a["keys"].float().t())) * DIM**-0.5
    ref = (ref * (a["head_w"].float() * IH**-0.5).unsqueeze(-1)).sum(dim=1)
    vis = a["visible"]
    return float((scores[vis] - ref[vis]).abs().max() / ref[vis].abs().max())


def decode(T: int, n_visible: int) -> None:
    visible = torch.zeros(1, T, dtype=torch.bool, device="cuda")
    visible[:, :n_visible] = True
    a = inputs(1, T, visible)
    shape = dict(phase="decode", T=T, visible=n_visible, k=K)
    record(**shape, path="torch fp32 matmul + topk", us=graph_us(lambda: torch_path(a)))
    record(
        **shape,
        path="kernels (op)",
        us=graph_us(lambda: kernel_path(a)),
        **agreement(kernel_path(a), torch_path(a)),
    )
    q = roped(a)
    for cfg in SCORES_DECODE:
        us = graph_us(lambda: index_scores(q, a["keys"], a["head_w"], visible, cfg))
        record(**shape, path=f"scores {cfg}", us=us)
    scores = index_scores(q, a["keys"], a["head_w"], visible)
    record(**shape, path="scores accuracy", rel_err=scores_err(q, a, scores))
    record(**shape, path="torch.topk + scatter on kernel scores", us=graph_us(lambda: topk_select(scores, K)))
    for cfg in SELECTS:
        record(
            **shape,
            path=f"select {cfg}",
            us=graph_us(lambda: select_top(scores, K, cfg)),
            **agreement(select_top(scores, K, cfg), topk_select(scores, K)),
        )


def prefill(S: int, T: int) -> None:
    positions = torch.arange(4 * T - S, 4 * T, device="cuda")  # the chunk that completes entry T-1
    visible = torch.arange(T, device="cuda") < ((positions + 1) // 4).unsqueeze(-1)
    a = inputs(S, T, visible)
    shape = dict(phase="prefill", S=S, T=T, k=K)
    if T <= TORCH_PREFILL_MAX:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        record(
            **shape,
            path="torch fp32 matmul + topk",
            ms=cuda_ms(lambda: torch_path(a), 5, warmup=1),
            peak_GB=(torch.cuda.max_memory_allocated() - base) / 1e9,
        )
        record(
            **shape,
            path="kernels (op)",
            ms=cuda_ms(lambda: kernel_path(a), 5, warmup=1),
            **agreement(kernel_path(a), torch_path(a)),
        )
    q = roped(a)
    scores = index_scores(q, a["keys"], a["head_w"], visible)
    record(**shape, path="scores accuracy", rel_err=scores_err(q, a, scores))
    record(
        **shape,
        path=f"scores default {default_scores_config(S, T)}",
        ms=cuda_ms(lambda: index_scores(q, a["keys"], a["head_w"], visible), 5, warmup=1),
    )
    for cfg in SCORES_PREFILL:
        ms = cuda_ms(lambda: index_scores(q, a["keys"], a["head_w"], visible, cfg), 5, warmup=1)
        record(**shape, path=f"scores {cfg}", ms=ms)
    record(
        **shape,
        path="torch.topk + scatter on kernel scores",
        ms=cuda_ms(lambda: topk_select(scores, K), 5, warmup=1),
    )
    record(
        **shape,
        path="select default",
        ms=cuda_ms(lambda: select_top(scores, K), 5, warmup=1),
        **agreement(select_top(scores, K), topk_select(scores, K)),
    )


DECODE_SHAPES = ((2048, (128, 2048)), (8192, (128, 8192)), (32768, (32768,)), (262144, (262144,)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="JSON file of every row")
    parser.add_argument("--prefill-only", action="store_true", help="only the 2048-row chunks")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    for T, visibles in () if args.prefill_only else DECODE_SHAPES:
        for n in visibles:
            decode(T, n)
    prefill(2048, 2048)
    prefill(2048, 32768)  # the last chunk of a 131,072-token prompt
    if args.out:
        with open(args.out, "w") as f:
            json.dump(RESULTS, f, indent=1)


if __name__ == "__main__":
    main()
