"""Temporary probe: where the fused mHC pre kernel's ~10 us go (variants of kernels/hc_pre.py, PDL off)."""
import json, sys
from pathlib import Path
import torch, triton, triton.language as tl
sys.path.insert(0, str(Path(__file__).resolve().parent))
from sweep_indexer import graph_us
from ds4serve.kernels.arrival import counters, last_to_arrive
from ds4serve.kernels.hc_pre import _row_coefficients, _collapse_and_norm
from ds4serve.kernels.hc_pre import hc_pre

@triton.jit
def _now(p):
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [p], dtype=tl.int64, is_pure=False, pack=1)

@triton.jit
def _probe(x_ptr, fn_ptr, base_ptr, scale_ptr, w_ptr, part_ptr, count_ptr, post_ptr, comb_ptr, y_ptr, t_ptr,
           D, iters, eps, norm_eps, HC: tl.constexpr, BLOCK: tl.constexpr, MIX_PAD: tl.constexpr,
           P_PAD: tl.constexpr, D_PAD: tl.constexpr, TAIL: tl.constexpr, FN: tl.constexpr, STAMP: tl.constexpr):
    p = tl.program_id(0)
    if STAMP:
        tl.atomic_min(t_ptr, _now(p))
    n_prog = tl.num_programs(0)
    s = tl.program_id(1).to(tl.int64)
    MIX: tl.constexpr = (2 + HC) * HC
    WIDTH: tl.constexpr = 1 + MIX
    N = HC * D
    x_row = x_ptr + s * N
    n = p * BLOCK + tl.arange(0, BLOCK)
    nm = n < N
    x = tl.load(x_row + n, mask=nm, other=0.0).to(tl.float32)
    m = tl.arange(0, MIX_PAD)
    part = part_ptr + (s * n_prog + p) * WIDTH
    tl.store(part, tl.sum(x * x, axis=0))
    if FN:
        f = tl.load(fn_ptr + m[:, None] * N + n[None, :], mask=(m[:, None] < MIX) & nm[None, :], other=0.0)
        tl.store(part + 1 + m, tl.sum(f * x[None, :], axis=1), mask=m < MIX)
    if STAMP:
        tl.atomic_max(t_ptr + 1, _now(p))
    if last_to_arrive(count_ptr + s, n_prog):
        if STAMP:
            tl.store(t_ptr + 2, _now(p))
        if TAIL >= 1:
            pre, post, comb = _row_coefficients(part_ptr + s * n_prog * WIDTH, n_prog, N, base_ptr, scale_ptr,
                                                iters, eps, norm_eps, HC, P_PAD)
            j = tl.arange(0, HC)
            tl.store(post_ptr + s * HC + j, post)
            tl.store(comb_ptr + s * HC * HC + j[:, None] * HC + j[None, :], comb)
            if STAMP:
                tl.store(t_ptr + 3, _now(p))
            if TAIL >= 2:
                _collapse_and_norm(x_row, pre, w_ptr, y_ptr + s * D, D, norm_eps, HC, D_PAD)
        if STAMP:
            tl.store(t_ptr + 4, _now(p))

def main(out):
    torch.manual_seed(0)
    D, HC, S, SITES = 4096, 4, 1, 86
    Xs = [torch.randn(S, HC, D, device="cuda", dtype=torch.bfloat16) for _ in range(SITES)]
    fns = [torch.randn(24, HC * D, device="cuda") * 0.01 for _ in range(SITES)]
    pad = [torch.empty(4 << 20, device="cuda") for _ in range(SITES)]  # 16 MB between sites' tensors
    base, scale, w = torch.randn(24, device="cuda"), torch.rand(3, device="cuda"), torch.rand(D, device="cuda")
    part = torch.empty(S, 256, 25, device="cuda"); post = torch.empty(S, HC, device="cuda")
    comb = torch.empty(S, HC, HC, device="cuda"); y = torch.empty(S, D, device="cuda", dtype=torch.bfloat16)
    t = torch.zeros(8, device="cuda", dtype=torch.int64)
    cnt = counters(Xs[0].device, 8)
    res = {}
    from ds4serve.kernels.hyper import hc_coefficients
    mixes = [torch.randn(S, 24, device="cuda") for _ in range(SITES)]
    for cold in (False, True):
        n = SITES if cold else 1
        def cycle(f):
            def run():
                for i in range(n):
                    f(i)
            return run
        r = {}
        r["hc_pre production"] = graph_us(cycle(lambda i: hc_pre(Xs[i], fns[i], base, scale, w, HC, 20, 1e-6, 1e-6)), calls=1) / n
        r["hc_coeff kernel"] = graph_us(cycle(lambda i: hc_coefficients(mixes[i], base, scale, HC, 20, 1e-6)), calls=1) / n
        for warps, block in ((1, 64), (4, 128), (8, 128), (4, 64)):
            P = HC * D // block
            for tail in (0, 1, 2):
                def call(i, warps=warps, block=block, P=P, tail=tail):
                    _probe[(P, S)](Xs[i], fns[i], base, scale, w, part, cnt, post, comb, y, t, D, 20, 1e-6, 1e-6, HC=HC,
                                   BLOCK=block, MIX_PAD=32, P_PAD=triton.next_power_of_2(P), D_PAD=4096, TAIL=tail,
                                   FN=1, STAMP=False, num_warps=warps)
                r[f"probe w{warps} b{block} tail{tail}"] = graph_us(cycle(call), calls=1) / n
        for k, v in r.items():
            print(("cold " if cold else "hot  ") + f"{k}: {v:.2f} us/call", flush=True)
        res["cold" if cold else "hot"] = r
    Path(out).write_text(json.dumps(res, indent=1))

if __name__ == "__main__":
    main(sys.argv[1])
