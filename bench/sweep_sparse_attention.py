"""Launch shapes of a prefill chunk's CSA attention read in place (kernels/sparse_attention.py) at
DeepSeek-V4-Flash's sizes: a 4096-token chunk, 64 heads of 512, a 128-key window, 512 selected entries per
query among 32,768 (the last chunk of a 131,072-token prompt), bf16; against the torch path's gathered copies
(with the softmax kernel). Each is event-timed over repeated calls after a warm-up (``check_gpu.timed``).

On the GPU machine, from the repository root::

    PYTHONPATH=. python3 bench/sweep_sparse_attention.py --out $OUT/sparse.json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from check_gpu import rel, sparse_attention_case, timed  # noqa: E402

from ds4serve.kernels import sparse_attention as sa  # noqa: E402
from ds4serve.model import chunk_attention as ca  # noqa: E402

CONFIGS = [
    sa.SparseAttentionConfig(16, 32, 4),
    sa.SparseAttentionConfig(16, 64, 4),
    sa.SparseAttentionConfig(32, 32, 4),
    sa.SparseAttentionConfig(32, 32, 8),
    sa.SparseAttentionConfig(32, 64, 8),
    sa.SparseAttentionConfig(64, 16, 8),
    sa.SparseAttentionConfig(64, 32, 8),
    sa.SparseAttentionConfig(64, 64, 8),
]


def record(row: dict) -> dict:
    print(
        " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True
    )
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--entries", type=int, default=32768)
    args = p.parse_args()
    q, seq, entries, slots, sinks, start = sparse_attention_case(args.rows, args.entries)
    d = q.shape[-1]
    in_place = ca._reads_in_place
    ca._reads_in_place = lambda q, visible: False
    want = ca.chunk_attention(q, seq, start, entries, slots, sinks, d**-0.5)
    ms = timed(lambda: ca.chunk_attention(q, seq, start, entries, slots, sinks, d**-0.5), reps=5)
    ca._reads_in_place = in_place
    rows = [record({"path": "torch, gathered copies", "ms": ms})]
    for cfg in CONFIGS:
        try:
            got = sa.sparse_chunk_attention(q, seq, 0, entries, slots, sinks, d**-0.5, cfg)
            ms = timed(
                lambda: sa.sparse_chunk_attention(q, seq, 0, entries, slots, sinks, d**-0.5, cfg), reps=5
            )
            rows.append(record({"path": "in place", **asdict(cfg), "ms": ms, "rel_err": rel(got, want)}))
        except Exception as exc:  # noqa: BLE001 - a launch shape the GPU cannot run is a row of the sweep
            rows.append(
                record({"path": "in place", **asdict(cfg), "error": f"{type(exc).__name__}: {exc}"[:200]})
            )
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
