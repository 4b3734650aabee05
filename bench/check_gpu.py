"""GPU correctness checks, run in the same device call as the benchmark.

1. every kernel against its torch reference at the proxy's real shapes, on fresh random data,
   outputs poisoned (NaN) beforehand, with the kernel's time and achieved bandwidth;
2. whole-model bf16 logits on the GPU (kernels on) against the float32 CPU forward on a tiny
   checkpoint, unquantized and FP8+MXFP4 kept quantized;
3. greedy tokens with the CUDA-graph decode equal to eager decode (engine, fp32 and bf16), and the
   graph's logits bitwise equal to the same static step run eagerly;
4. verify graphs: a captured block's logits bitwise equal to the same static block run eagerly and
   close to the chunk forward, the state after ``commit_static`` equal to the chunk's commit, and speculative greedy tokens through the graphs (verify blocks, MTP and
   DSpark draft passes) equal to plain decoding; in bf16, a captured block no further from the float32
   CPU forward than the bf16 chunk forward;
5. a layer split (cuda:0 and the last GPU; both on cuda:0 on a one-GPU machine) decoding through one
   graph per shard and verifying through one per shard: greedy tokens equal to the whole model's;
6. structured output through the decode graph (when llguidance is installed): a JSON schema's and a forced
   tool call's answers, greedy and sampled, parse and follow the schema; speculative constrained greedy
   decoding through the verify graphs equals plain (fp32).

Prints one line per check and exits non-zero when one fails. Usage::

    PYTHONPATH=. python3 bench/check_gpu.py --out $OUT/checks.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import traceback
from pathlib import Path

import torch

from ds4serve import Engine, SamplingParams, kernels
from ds4serve.engine.cuda_graphs import DecodeGraph, VerifyGraph, delta_at
from ds4serve.engine.drafts import OracleProposer, PredictionProposer
from ds4serve.kernels.gemv import GemvConfig, default_config, gemv, gemv_pair, gemv_ref
from ds4serve.kernels.hc_pre import hc_merge_pre, hc_pre
from ds4serve.kernels.hc_streams import hc_mixes
from ds4serve.kernels.hyper import hc_coefficients
from ds4serve.kernels.moe import ExpertStack, moe_fused, moe_ref
from ds4serve.model import DeepSeekV4, hyper
from ds4serve.model.chunk_attention import chunk_attention
from ds4serve.model.hyper import HCSite, hc_merge, hc_split, sum_terms
from ds4serve.model.hyper import hc_coefficients as hc_coefficients_ref
from ds4serve.model.norms import rms_norm
from ds4serve.quant import FP4Weight, quantize_fp8
from ds4serve.tiny import TinySpec, make_tiny
from ds4serve.weights import Checkpoint

RESULTS: list[dict] = []


def record(name: str, ok: bool, **info) -> None:
    RESULTS.append({"check": name, "ok": bool(ok), **info})
    extras = " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in info.items())
    print(f"{'PASS' if ok else 'FAIL'} {name} {extras}", flush=True)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a.float() - b.float()).norm() / b.float().norm())


def poison_allocator(nbytes: int) -> None:
    """Fill a freed block with NaN so that a kernel's torch.empty output starts poisoned."""
    torch.full((nbytes // 2 + 1024,), float("nan"), device="cuda", dtype=torch.bfloat16)


def timed(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / reps


def fp4_random(E: int, rows: int, cols: int) -> FP4Weight:
    data = torch.randint(-128, 128, (E, rows, cols // 2), device="cuda", dtype=torch.int8)
    exps = torch.randint(115, 121, (E, rows, cols // 32), device="cuda", dtype=torch.uint8)
    return FP4Weight(data, exps)


def check_gemv() -> None:
    """Dense bf16 and FP8 GEMV at the proxy's shapes: the default config, a tensor-core one with split-K,
    a CUDA-core one and for one token a vector tile with split-K. Each timing repeats one weight (L2-warm
    below 50 MB): bench/sweep_gemv.py measures the DRAM rates."""
    for rows, cols, groups in ((32768, 1024, 1), (8192, 4096, 8), (4096, 8192, 1)):
        dense_w = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16) / cols**0.5
        q = quantize_fp8(dense_w)
        for tokens in (1, 4):
            x = torch.randn(tokens, groups, cols, device="cuda", dtype=torch.bfloat16)
            xin = x if groups > 1 else x[:, 0]
            for kind, w, s, block in (("bf16", dense_w, None, None), ("fp8", q.data, q.scale, q.block)):
                ref = gemv_ref(x, w, s, block, groups)
                default = default_config(kind, rows, cols, tokens, groups, block)
                vec = (GemvConfig(32, 512, split=2, stages=1, vec=True),) if tokens == 1 else ()
                for c in (
                    default,
                    GemvConfig(64, 128, split=4, dot=True),
                    GemvConfig(16, 512 if tokens == 1 else 128, split=2),
                    *vec,
                ):
                    poison_allocator(tokens * rows * 4 * max(c.split, 1))
                    out = gemv(xin, w, s, block, groups, config=c)
                    ms = timed(lambda: gemv(xin, w, s, block, groups, config=c))
                    err = rel(out, ref)
                    record(
                        f"kernel gemv {kind} {rows}x{cols} groups={groups} N={tokens} {c}",
                        err <= 1e-2,
                        rel_err=err,
                        ms=ms,
                        GBps=w.numel() * w.element_size() / ms / 1e6,
                    )
            if groups == 1:
                ms = timed(lambda: torch.nn.functional.linear(xin, dense_w))
                record(
                    f"torch bf16 gemv {rows}x{cols} N={tokens} (reference speed)",
                    True,
                    ms=ms,
                    GBps=2 * rows * cols / ms / 1e6,
                )


def check_gemv_pair() -> None:
    """A layer's two input products in one launch (``gemv_pair``): FP8 ``wq_a``+``wkv`` (1536 rows) with the
    bf16 compressors of an HCA layer (1024 rows) and of a CSA layer with its indexer (2624 rows), one token,
    against each product's reference and against the two launches it replaces."""
    for dense_rows in (1024, 2624):
        q = quantize_fp8(torch.randn(1536, 4096, device="cuda", dtype=torch.bfloat16) / 64)
        dense_w = torch.randn(dense_rows, 4096, device="cuda", dtype=torch.bfloat16) / 64
        x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
        a, b = (q.data, q.scale, q.block), (dense_w, None, None)
        poison_allocator((1536 + dense_rows) * 4)
        ya, yb = gemv_pair(x, a, b)
        err = max(rel(ya, gemv_ref(x, *a)), rel(yb, gemv_ref(x, *b)))
        two = (gemv(x, *a), gemv(x, *b))
        ms, ms_two = timed(lambda: gemv_pair(x, a, b)), timed(lambda: (gemv(x, *a), gemv(x, *b)))
        record(
            f"kernel gemv_pair fp8 1536x4096 + bf16 {dense_rows}x4096 N=1",
            err <= 1e-2,
            rel_err=err,
            equal_to_two_launches=bool(torch.equal(ya, two[0]) and torch.equal(yb, two[1])),
            ms=ms,
            ms_two_launches=ms_two,
        )


def check_moe() -> None:
    """Fused MoE at the proxy's shapes: 6 routed experts of 32 plus the shared expert (bf16, FP8 with
    FP8 shared, MXFP4 with FP8 shared). Timings repeat one layer's weights; bench/sweep_moe.py
    measures the DRAM rates and picks the tiles."""
    D, inter, E, k = 4096, 2048, 32, 6
    shapes = [(inter, D), (inter, D), (D, inter)]
    for quant in ("bf16", "fp8", "fp4"):
        if quant == "fp4":
            routed = [fp4_random(E, *s) for s in shapes]
            stacks = [ExpertStack(w.data, w.scale) for w in routed]
        else:
            mats = [torch.randn(E, *s, device="cuda", dtype=torch.bfloat16) / s[-1] ** 0.5 for s in shapes]
            routed = [quantize_fp8(m) for m in mats] if quant == "fp8" else mats
            stacks = [
                ExpertStack(m) if quant == "bf16" else ExpertStack(m.data, m.scale, m.block) for m in routed
            ]
        shared_mats = [torch.randn(s, device="cuda", dtype=torch.bfloat16) / s[-1] ** 0.5 for s in shapes]
        shared_w = shared_mats if quant == "bf16" else [quantize_fp8(m) for m in shared_mats]
        shared = tuple(
            ExpertStack(m) if quant == "bf16" else ExpertStack(m.data, m.scale, m.block) for m in shared_w
        )
        shared_dense = [m if quant == "bf16" else m.dequantize(torch.float32) for m in shared_w]
        for tokens in (1, 4):
            x = torch.randn(tokens, D, device="cuda", dtype=torch.bfloat16)
            idx = torch.stack([torch.randperm(E, device="cuda")[:k] for _ in range(tokens)])
            wts = torch.rand(tokens, k, device="cuda")
            used, local = torch.unique(idx, return_inverse=True)
            dense = [m[used] if quant == "bf16" else m[used].dequantize(torch.float32) for m in routed]
            ref = moe_ref(x, local, wts, *dense, 10.0, shared=tuple(shared_dense))
            poison_allocator(tokens * (k + 1) * (D + inter) * 4)
            out = moe_fused(x, idx, wts, *stacks, 10.0, shared=shared)
            ms = timed(lambda: moe_fused(x, idx, wts, *stacks, 10.0, shared=shared))
            err = rel(out, ref)
            nbytes = (
                sum(s.data[0].nbytes + (s.scale[0].nbytes if s.quant else 0) for s in stacks) * used.numel()
            )
            nbytes += sum(s.data.nbytes + (s.scale.nbytes if s.quant else 0) for s in shared)
            record(
                f"kernel moe_fused {quant} routed + shared N={tokens} k=6",
                err <= 1e-2,
                rel_err=err,
                ms=ms,
                GBps=nbytes / ms / 1e6,
            )
            del dense


def check_kernels() -> None:
    check_moe()
    check_gemv()
    check_gemv_pair()
    mixes = torch.randn(2053, 24, device="cuda")  # whole blocks of tokens and a partial one
    base, scale = 0.1 * torch.randn(24, device="cuda"), 1 + 0.1 * torch.randn(3, device="cuda")
    got = hc_coefficients(mixes, base, scale, 4, 20, 1e-6)
    want = hc_coefficients_ref(mixes, base, scale, 4, 20, 1e-6)
    err = max(rel(g, w) for g, w in zip(got, want))
    record(
        "kernel hc_coefficients",
        err <= 1e-5,
        rel_err=err,
        ms=timed(lambda: hc_coefficients(mixes, base, scale, 4, 20, 1e-6)),
    )
    check_mixes()
    check_hc_pre()
    check_hc_merge_pre()
    check_sparse_attention()


def sparse_attention_case(S: int, E: int) -> tuple[torch.Tensor, ...]:
    """A prefill chunk of ``S`` queries over ``E`` CSA entries at DeepSeek-V4-Flash's sizes (64 heads of 512,
    a 128-key window, 512 entries selected per query, bf16), the chunk that completes entry ``E - 1``:
    ``(q, window sequence, entries, index slots, sinks, start)``."""
    H, d, W, k = 64, 512, 128, 512
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(S, H, d, device="cuda", dtype=torch.bfloat16, generator=g)
    seq = torch.randn(W - 1 + S, d, device="cuda", dtype=torch.bfloat16, generator=g)
    entries = torch.randn(E, d, device="cuda", dtype=torch.bfloat16, generator=g)
    sinks = torch.randn(H, device="cuda", generator=g)
    slots = torch.rand(S, E, device="cuda", generator=g).topk(k, dim=-1).indices.sort(dim=-1).values
    return q, seq, entries, slots.to(torch.int32), sinks, 4 * E - S


def check_sparse_attention() -> None:
    """A 4096-token prefill chunk's CSA attention at the real size (:func:`sparse_attention_case` over 32,768
    entries) read in place against the torch path's gathered copies."""
    q, seq, entries, slots, sinks, start = sparse_attention_case(4096, 32768)
    d = q.shape[-1]
    slots[-1, slots.shape[1] // 2 :] = -1  # a row with fewer selected entries than places
    with kernels.disabled():
        want = chunk_attention(q, seq, start, entries, slots, sinks, d**-0.5)
    got = chunk_attention(q, seq, start, entries, slots, sinks, d**-0.5)
    err = rel(got, want)
    record(
        "kernel sparse chunk attention S=4096 k=512",
        err <= 1e-2,
        rel_err=err,
        ms=timed(lambda: chunk_attention(q, seq, start, entries, slots, sinks, d**-0.5), reps=5),
    )


def check_mixes() -> None:
    """A prefill chunk's mHC mixes at the real size (hc=4, D=4096, bf16 streams) against the torch code (fp32
    norm and GEMM), and a row's mixes alone equal to the same row's in the chunk."""
    site, _ = _hc_site(4, 4096)
    for S in (9, 2048):
        X = torch.randn(S, 4, 4096, device="cuda", dtype=torch.bfloat16)
        with kernels.disabled():
            want = hyper._hc_mixes.eager(X, site.fn, 1e-6)
        got = hc_mixes(X, site.fn, 1e-6)
        alone = torch.equal(hc_mixes(X[-1:].clone(), site.fn, 1e-6), got[-1:])
        err = rel(got, want)
        record(
            f"kernel hc_mixes S={S}",
            err <= 1e-5 and alone,
            rel_err=err,
            alone=alone,
            ms=timed(lambda: hc_mixes(X, site.fn, 1e-6)),
        )


def check_hc_pre() -> None:
    """The fused mHC pre site at the real size (hc=4, D=4096) against hc_split then
    rms_norm run as torch code, outputs poisoned; a second launch and three replays of a captured one give
    the same bits (the arrival counters are left at zero). ms is one launch outside a graph."""
    hc, D, iters, eps = 4, 4096, 20, 1e-6
    site, norm_w = _hc_site(hc, D)
    for dtype in (torch.float32, torch.bfloat16):
        for S in (1, 4, 8):
            X = torch.randn(S, hc, D, device="cuda", dtype=dtype)
            with kernels.disabled():
                post, comb, y = hc_split(X, site, hc, iters, eps, eps)
                want = (post, comb, rms_norm(y, norm_w, eps))

            def run():
                return hc_pre(X, site.fn, site.base, site.scale, norm_w, hc, iters, eps, eps)

            got, same = _run_site(run, S, S * (D + 128 * 25 + 24) * 4)
            errs = [rel(g, w) for g, w in zip(got, want)]
            ok = same and max(errs[:2]) <= 1e-5 and errs[2] <= _x_in_tol(dtype)
            record(
                f"kernel hc_pre {str(dtype)[6:]} S={S} hc=4 D=4096",
                ok,
                post_comb_rel_err=max(errs[:2]),
                x_in_rel_err=errs[2],
                repeatable=same,
                ms=timed(run),
            )


def check_hc_merge_pre() -> None:
    """The same with the merge before the site (hc_merge_pre, the attention -> MoE boundary) against hc_merge,
    hc_split and rms_norm run as torch code. The merged streams round as hc_merge's product-sum does: equal up to the summation order of the fp32 stream mix and fused multiply-adds
    (fp32), which in bf16 can move a rare value by an ulp. The sublayer output is given as is, or (S = 1, 4)
    as the fused MoE's 7 fp32 slot terms ``[S, 7, D]``, which the kernel sums as the MoE's slot-sum launch
    does: every output must then have the bits it has with their sum given instead (``sum_terms``, what that
    launch stores)."""
    hc, D, iters, eps = 4, 4096, 20, 1e-6
    site, norm_w = _hc_site(hc, D)
    cases = [(S, False) for S in (1, 4, 8)] + [(1, True), (4, True)]
    for dtype in (torch.float32, torch.bfloat16):
        for S, terms in cases:
            X = torch.randn(S, hc, D, device="cuda", dtype=dtype)
            given = (
                torch.randn(S, 7, D, device="cuda") / 4
                if terms
                else torch.randn(S, D, device="cuda", dtype=dtype)
            )
            out = sum_terms(given, dtype) if terms else given
            post = 2 * torch.rand(S, hc, device="cuda")
            comb = hc_coefficients_ref(
                torch.randn(S, 24, device="cuda"), site.base, site.scale, hc, iters, eps
            )[2]
            with kernels.disabled():
                merged = hc_merge(X, out, post, comb)
                post_n, comb_n, y = hc_split(merged, site, hc, iters, eps, eps)
                want = (merged, post_n, comb_n, rms_norm(y, norm_w, eps))

            def run(given=given):
                return hc_merge_pre(
                    X, given, post, comb, site.fn, site.base, site.scale, norm_w, hc, iters, eps, eps
                )

            got, same = _run_site(run, S, S * ((hc + 1) * D + 128 * 25 + 24) * 4)
            errs = [rel(g, w) for g, w in zip(got, want)]
            as_summed = not terms or all(torch.equal(g, w) for g, w in zip(got, run(out)))
            ok = (
                same
                and as_summed
                and errs[0] <= (1e-6 if dtype == torch.float32 else 2**-8)
                and max(errs[1:3]) <= 1e-5
                and errs[3] <= _x_in_tol(dtype)
            )
            record(
                f"kernel hc_merge_pre {str(dtype)[6:]} S={S} hc=4 D=4096{' slot terms' if terms else ''}",
                ok,
                merged_rel_err=errs[0],
                post_comb_rel_err=max(errs[1:3]),
                x_in_rel_err=errs[3],
                repeatable=same,
                as_summed=as_summed,
                ms=timed(run),
            )


def _hc_site(hc: int, D: int) -> tuple[HCSite, torch.Tensor]:
    """A random mHC site and sublayer norm weight of the real scale."""
    site = HCSite(
        torch.randn(24, hc * D, device="cuda") / (hc * D) ** 0.5,
        0.1 * torch.randn(24, device="cuda"),
        1 + 0.1 * torch.randn(3, device="cuda"),
    )
    return site, 1 + 0.1 * torch.randn(D, device="cuda")


def _x_in_tol(dtype: torch.dtype) -> float:
    """A fused site's normed sublayer input against the torch code's: fp32 rounding, or bf16's."""
    return 1e-5 if dtype == torch.float32 else 2**-8


def _run_site(run, S: int, nbytes: int) -> tuple[tuple[torch.Tensor, ...], bool]:
    """``run()``'s outputs on memory poisoned beforehand (``nbytes``), and whether a second launch and, for
    ``S = 1``, three replays of a captured one give the same bits."""
    poison_allocator(nbytes)
    got = run()
    same = all(torch.equal(a, b) for a, b in zip(got, run()))
    if S == 1:
        same = same and _replays_equal(run, got)
    return got, same


def _replays_equal(run, want: tuple[torch.Tensor, ...]) -> bool:
    """``run`` captured in a CUDA graph (after a warm-up on a side stream): three replays give ``want``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    same = True
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        same = same and all(torch.equal(a, b) for a, b in zip(out, want))
    return same


def _chunked_logits(model: DeepSeekV4, ids: list[int], sizes: tuple[int, ...]) -> torch.Tensor:
    with torch.inference_mode():
        state = model.new_state(len(ids))
        logits = []
        for size in sizes:
            r = model.forward(ids[state.pos : state.pos + size], state, logit_rows=slice(None))
            state.commit(r.delta, size)
            logits.append(r.logits)
        return torch.cat(logits).float().cpu()


def check_tiny(root: Path) -> None:
    """fp32 on the GPU (kernels on) must match the CPU fp32 forward tightly; bf16 on the GPU must be
    no further from it than the CPU's own bf16 forward is (random tiny models route differently in
    bf16 at some positions, so a fixed max-error bound would measure the model, not the code)."""
    ids = torch.randint(3, 128000, (200,), generator=torch.Generator().manual_seed(3)).tolist()
    sizes = (64, 1, 12, 123)  # a 12-row chunk: FP8 GEMVs on tensor-core tiles and fused mHC sites past 8 rows
    for quant in ("none", "fp8+fp4"):
        path = make_tiny(root / quant, TinySpec(seed=4, quantize=quant))
        ckpt = Checkpoint(path)
        kept = quant != "none"
        ref = _chunked_logits(DeepSeekV4.load(ckpt), ids, sizes)
        gpu32 = _chunked_logits(DeepSeekV4.load(ckpt, device="cuda", quantized=kept), ids, sizes)
        err32 = float((gpu32 - ref).abs().max() / ref.abs().max())
        record(f"tiny fp32 GPU (kernels) vs fp32 CPU logits, quantize={quant}", err32 <= 1e-4, max_rel=err32)
        cpu16 = _chunked_logits(DeepSeekV4.load(ckpt, dtype=torch.bfloat16), ids, sizes)
        gpu16 = _chunked_logits(
            DeepSeekV4.load(ckpt, dtype=torch.bfloat16, device="cuda", quantized=kept), ids, sizes
        )
        e_cpu, e_gpu = rel(cpu16, ref), rel(gpu16, ref)
        top1 = float((gpu16.argmax(-1) == ref.argmax(-1)).float().mean())
        record(
            f"tiny bf16 GPU vs fp32 CPU logits, quantize={quant}",
            e_gpu <= 2 * e_cpu + 0.01,
            rel_err=e_gpu,
            cpu_bf16_rel_err=e_cpu,
            top1_agreement=top1,
        )


def _greedy_graph_vs_eager(path: Path, prompt: list[int], max_context: int, tokens: int) -> Engine:
    """Greedy tokens after ``prompt`` through the decode graph == the same steps run eagerly (float32; bf16
    only reports how many match). Returns the bf16 engine."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for dtype in ("float32", "bfloat16"):
        engine = Engine.from_pretrained(
            path, device="cuda", dtype=dtype, max_context=max_context, max_batch=1
        )
        engine.eager = True
        eager = engine.generate(prompt, params)
        engine.eager = False
        graph = engine.generate(prompt, params)
        same = sum(a == b for a, b in zip(eager.tokens, graph.tokens))
        ok = (
            eager.error is None and graph.error is None and (same == len(eager.tokens) or dtype == "bfloat16")
        )
        record(
            f"greedy tokens graph == eager ({dtype}, {len(prompt)}-token prompt, {tokens} tokens)",
            ok,
            matching=same,
            errors=f"{eager.error_message}/{graph.error_message}",
        )
    return engine


def check_long_graphs(root: Path) -> None:
    """Long context on the tiny model: a 20,000-token prompt gives 5,000 CSA entries, so that each decode
    step's indexer selection is split over programs and its attention reads the open entry in place."""
    path = make_tiny(root / "long", TinySpec(seed=5, window=8, hca_rate=8, index_topk=5))
    prompt = torch.randint(3, 128000, (20000,), generator=torch.Generator().manual_seed(11)).tolist()
    _greedy_graph_vs_eager(path, prompt, max_context=20480, tokens=32)


def check_graphs(root: Path) -> None:
    path = make_tiny(root / "graphs", TinySpec(seed=5, window=8, hca_rate=8, index_topk=5))
    prompt = torch.randint(3, 128000, (37,), generator=torch.Generator().manual_seed(9)).tolist()
    engine = _greedy_graph_vs_eager(path, prompt, max_context=128, tokens=48)
    model = engine.model
    with torch.inference_mode():
        a, b = model.new_state(128), model.new_state(128)
        for s in (a, b):
            s.commit(model.forward(prompt, s).delta, len(prompt))
        graph = DecodeGraph(model, b)
        worst, first_logits, first_state = (
            0.0,
            None,
            None,
        )  # the first step that differs, to localise a failure
        for step, t in enumerate(prompt[:30]):
            pos = a.pos
            ra = model.forward(
                torch.tensor([t], device="cuda"),
                a,
                logit_rows=slice(0, 1),
                positions=torch.tensor([pos], device="cuda"),
            )
            a.commit(delta_at(ra.delta, pos, t), 1)
            rb = graph.step(t).logits
            diff = float((ra.logits - rb).abs().max())
            worst = max(worst, diff)
            if diff and first_logits is None:
                first_logits = step
            if first_state is None and _differing_rows(a, b):
                first_state = (step, _differing_rows(a, b)[:4])
        record(
            "graph replay logits == same static step run eagerly (bf16, 30 steps)",
            worst == 0.0,
            max_abs=worst,
            first_step=first_logits,
        )
        record(
            "state written by the graph == host commit of the same steps",
            first_state is None,
            first_step_and_tensors=first_state,
        )


def check_verify_graphs(root: Path) -> None:
    path = make_tiny(root / "verify", TinySpec(seed=6, window=8, hca_rate=8, index_topk=5, mtp=1))
    prompt = torch.randint(3, 128000, (37,), generator=torch.Generator().manual_seed(10)).tolist()
    engine = Engine.from_pretrained(path, device="cuda", dtype="float32", max_context=160, max_batch=1)
    plain = engine.generate(prompt, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    model = engine.model
    with torch.inference_mode():
        a, b, c = (model.new_state(160) for _ in range(3))
        for s in (a, b, c):
            s.commit(model.forward(prompt, s).delta, len(prompt))
        graph = VerifyGraph(model, b, 4)
        worst_eager, worst_chunk, first_state = 0.0, 0.0, None
        ids = plain.tokens
        for step, accepted in enumerate((2, 4, 1, 3, 0, 4, 2, 3)):
            block = ids[a.pos - len(prompt) : a.pos - len(prompt) + 4]
            ra = model.forward(
                torch.tensor(block, device="cuda"),
                a,
                logit_rows=slice(None),
                positions=torch.arange(a.pos, a.pos + 4, device="cuda"),
            )
            rc = model.forward(block, c, logit_rows=slice(None))
            rb = graph.run(block)
            worst_eager = max(worst_eager, float((ra.logits - rb.logits).abs().max()))
            worst_chunk = max(worst_chunk, float((rc.logits - rb.logits).abs().max() / rc.logits.abs().max()))
            a.commit_static(ra.delta, block[:accepted])
            b.commit_static(rb.delta, block[:accepted])
            c.commit(rc.delta, accepted)
            if first_state is None and _differing_rows(a, b):
                first_state = (step, _differing_rows(a, b)[:4])
        record(
            "verify graph logits == same static block run eagerly (fp32, width 4, 8 steps)",
            worst_eager == 0.0,
            max_abs=worst_eager,
        )
        record("verify graph logits == chunk forward (fp32)", worst_chunk <= 1e-5, max_rel=worst_chunk)
        record(
            "state after commit_static of the graph's block == of the eager block",
            first_state is None,
            first_step_and_tensors=first_state,
        )
        known = prompt + plain.tokens
        edited = (
            plain.tokens[:10] + [7, 8, 9] + plain.tokens[16:]
        )  # a predicted output with an insert and a cut
        for spec in (
            OracleProposer(known, 0.7, 2),
            OracleProposer(known, 0.7, 4),
            OracleProposer(known, 0.7, 6),
            OracleProposer(known, 0.7, 12),
            "mtp:3",
            PredictionProposer(edited),
        ):
            _check_speculative(engine, prompt, plain.tokens, spec)
        dspark = Engine.from_pretrained(
            make_tiny(root / "dspark", TinySpec(seed=7, dspark=True)),
            device="cuda",
            dtype="float32",
            max_context=160,
        )
        reference = dspark.generate(prompt, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
        _check_speculative(dspark, prompt, reference.tokens, "dspark")


def check_split_graphs(root: Path) -> None:
    """A layer split (3 + 3 layers; on cuda:0 and the last GPU) decodes through one graph per shard and
    verifies through one per shard: the same tokens as the whole model's graphs (fp32); the MTP and
    DSpark drafts run as graphs on the last GPU, their embedding rows looked up on the first."""
    path = make_tiny(root / "split", TinySpec(seed=8, window=8, hca_rate=8, index_topk=5, mtp=1))
    prompt = torch.randint(3, 128000, (37,), generator=torch.Generator().manual_seed(11)).tolist()
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    whole = Engine.from_pretrained(path, device="cuda", dtype="float32", max_context=160, max_batch=1)
    last = f"cuda:{torch.cuda.device_count() - 1}"
    split = Engine.from_pretrained(
        path, devices=["cuda:0", last], layer_split=[3, 3], dtype="float32", max_context=160
    )
    plain = whole.generate(prompt, params)
    res = split.generate(prompt, params)
    kind = type(split._graph).__name__
    record(
        f"split decode graphs (cuda:0 + {last}) == whole-model graph, greedy (fp32)",
        res.error is None and res.tokens == plain.tokens and kind == "SplitDecodeGraph",
        matching=sum(x == y for x, y in zip(res.tokens, plain.tokens)),
        graph=kind,
        error=res.error_message,
    )
    _check_speculative(split, prompt, plain.tokens, OracleProposer(prompt + plain.tokens, 0.7, 4), "split, ")
    _check_split_drafts(split, prompt, plain.tokens, "mtp:3")
    dspark = make_tiny(root / "split-dspark", TinySpec(seed=7, dspark=True))
    reference = Engine.from_pretrained(dspark, device="cuda", dtype="float32", max_context=160)
    n = reference.cfg.num_layers
    _check_split_drafts(
        Engine.from_pretrained(
            dspark,
            devices=["cuda:0", last],
            layer_split=[n // 2, n - n // 2],
            dtype="float32",
            max_context=160,
        ),
        prompt,
        reference.generate(prompt, params).tokens,
        "dspark",
    )


def _check_split_drafts(split: Engine, prompt: list[int], plain: list[int], spec: str) -> None:
    """Speculative decoding with a model draft on ``split``: its passes as graphs on the last shard's
    GPU, the same tokens as plain decoding; and the time per generated token with the draft's passes
    eager, for comparison (informational, tiny model)."""
    from ds4serve.engine.drafts import resolve_proposer

    proposer = resolve_proposer(split, spec)
    _check_speculative(split, prompt, plain, proposer, f"split, {spec} drafts as graphs, ")
    graphs = proposer.passes
    ms = {}
    for static in (True, False):
        for _ in range(2):  # the second run, without the first one's captures and compiles
            drafts = resolve_proposer(split, spec)
            if not static:
                drafts.passes = None
            res = split.generate(
                prompt, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), speculative=drafts
            )
        ms["graphs" if static else "eager"] = round(
            res.timings.decode_s * 1e3 / max(len(res.tokens) - 1, 1), 2
        )
    drafted = getattr(graphs, "_step", None) or getattr(graphs, "_block", None)
    record(
        f"split: the {spec} drafts ran as graphs on the last GPU",
        graphs is not None and graphs.graph and drafted is not None,
        decode_ms_per_token=ms,
    )


def check_bf16_verify_block(root: Path) -> None:
    """In bf16 a captured verify block may round differently from the chunk forward, but it must be no
    further from the float32 CPU forward than the bf16 chunk forward of the same tokens is (a bf16-only
    fault of the static block would show here; the exact checks above run in float32)."""
    path = make_tiny(root / "verify16", TinySpec(seed=6, window=8, hca_rate=8, index_topk=5))
    ids = torch.randint(3, 128000, (45,), generator=torch.Generator().manual_seed(12)).tolist()
    prompt, block = ids[:37], ids[37:43]
    ckpt = Checkpoint(path)
    ref = _chunked_logits(DeepSeekV4.load(ckpt), prompt + block, (37, 6))[37:]
    model = DeepSeekV4.load(ckpt, dtype=torch.bfloat16, device="cuda", quantized=False)
    with torch.inference_mode():
        states = [model.new_state(64) for _ in range(2)]
        for s in states:
            s.commit(model.forward(prompt, s).delta, len(prompt))
        chunk = model.forward(block, states[0], logit_rows=slice(None)).logits.float().cpu()
        graph = VerifyGraph(model, states[1], len(block)).run(block).logits.float().cpu()
    e_graph, e_chunk = rel(graph, ref), rel(chunk, ref)
    record(
        "bf16 verify graph (width 6) vs fp32 CPU logits, no further than the bf16 chunk forward",
        e_graph <= 2 * e_chunk + 0.01,
        rel_err=e_graph,
        chunk_rel_err=e_chunk,
        top1_agreement=float((graph.argmax(-1) == ref.argmax(-1)).float().mean()),
    )


def _check_speculative(engine: Engine, prompt: list[int], plain: list[int], spec, where: str = "") -> None:
    """Greedy speculative decoding with ``spec`` through the graphs equals plain decoding."""
    res = engine.generate(
        prompt, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), speculative=spec
    )
    graphs = len(engine._verify_graphs)
    name = spec if isinstance(spec, str) else f"{spec.name} width {spec.max_draft_tokens + 1}"
    record(
        f"speculative greedy through the graphs == plain decoding ({where}fp32, {name})",
        res.error is None and res.tokens == plain and graphs > 0,
        matching=sum(x == y for x, y in zip(res.tokens, plain)),
        graphs=graphs,
        drafted=res.stats.speculative.get("drafted") if res.stats.speculative else None,
        accepted=res.stats.speculative.get("accepted") if res.stats.speculative else None,
        error=res.error_message,
    )


def _differing_rows(a, b) -> list[str]:
    """The committed state tensors (layer.name) where two states differ."""
    sa, sb = a.snapshot(), b.snapshot()  # the committed rows only
    return [
        f"{i}.{k}"
        for i in sa.layers
        for k in sa.layers[i]
        if not torch.equal(sa.layers[i][k], sb.layers[i][k])
    ]


def check_constrained(root: Path) -> None:
    """Answers held by llguidance's masks on the GPU (the mask is computed on the host each answer token and
    applied to the graph's logits): a JSON schema and a forced tool call, greedy and sampled, on a tiny random
    model whose free output is neither; speculative constrained greedy decoding (MTP and oracle drafts, the
    verify graphs) equal to plain in fp32. What the mask costs a token is bench/constrained_gpu.py's to measure."""
    try:
        import llguidance  # noqa: F401
    except ImportError:
        record("constrained: llguidance installed", False, error="llguidance is not installed")
        return
    from ds4serve.server.output_parser import OutputParser, merged
    from ds4serve.server.tool_grammar import forced_tool_call

    schema = {
        "type": "object",
        "additionalProperties": False,
        "required": ["ok", "color"],
        "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
    }
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "required": ["city", "days"],
                "properties": {
                    "city": {"type": "string", "maxLength": 8},
                    "days": {"type": "integer", "minimum": 1, "maximum": 9},
                },
            },
        },
    }
    path = make_tiny(root / "constrained", TinySpec(seed=5, window=8, hca_rate=8, index_topk=5, mtp=1))
    prompt = torch.randint(3, 128000, (37,), generator=torch.Generator().manual_seed(9)).tolist()
    engine = Engine.from_pretrained(path, device="cuda", dtype="bfloat16", max_context=512)
    tok = engine.tokenizer
    engine.warm_up()
    for temperature, seed in ((0.0, None), (1.0, 3)):
        res = engine.generate(
            prompt, SamplingParams(max_tokens=120, temperature=temperature, seed=seed, json_schema=schema)
        )
        try:
            doc = json.loads(tok.decode(res.tokens[:-1]))
            ok = res.ok and set(doc) == {"ok", "color"} and doc["color"] in ("red", "green", "blue")
        except ValueError:
            doc, ok = None, False
        record(
            f"json_schema answer through the graph (bf16, temperature {temperature})",
            ok,
            document=doc,
            error=res.error_message,
        )
        grammar = forced_tool_call([tool], tok, name="get_weather")
        res = engine.generate(
            prompt, SamplingParams(max_tokens=200, temperature=temperature, seed=seed, grammar=grammar)
        )
        parser = OutputParser(thinking=False, tools={"get_weather"})
        delta = merged(parser.feed(tok.decode(res.tokens[:-1])) + parser.finish())
        calls = [json.loads(c.arguments) for c in delta.tool_calls]
        ok = res.ok and len(calls) == 1 and not delta.content and 1 <= calls[0].get("days", 0) <= 9
        record(
            f"forced tool call through the graph (bf16, temperature {temperature})",
            ok,
            calls=calls,
            error=res.error_message,
        )
    fp32 = Engine.from_pretrained(path, device="cuda", dtype="float32", max_context=512)
    held = SamplingParams(max_tokens=120, temperature=0.0, json_schema=schema)
    plain = fp32.generate(prompt, held)
    for spec in ("mtp", OracleProposer(prompt + plain.tokens, 0.7, 4)):
        res = fp32.generate(prompt, held, speculative=spec)
        record(
            f"speculative constrained greedy == plain, through the graphs (fp32, {spec})",
            res.ok and res.tokens == plain.tokens and bool(res.stats.speculative),
            tokens=len(res.tokens),
            error=res.error_message,
        )


CHECKS = {
    "kernels": lambda tmp: check_kernels(),
    "tiny": check_tiny,
    "graphs": check_graphs,
    "long_graphs": check_long_graphs,
    "verify_graphs": check_verify_graphs,
    "bf16_verify_block": check_bf16_verify_block,
    "split_graphs": check_split_graphs,
    "constrained": check_constrained,
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument(
        "--out", type=Path, default=None, help="JSON file of every check, written after each group"
    )
    p.add_argument(
        "--only", default="", help=f"comma-separated checks to run (default: all): {', '.join(CHECKS)}"
    )
    args = p.parse_args()
    only = [c for c in args.only.split(",") if c] or list(CHECKS)
    if set(only) - set(CHECKS):
        raise SystemExit(
            f"--only: unknown {sorted(set(only) - set(CHECKS))}; expected some of {list(CHECKS)}"
        )
    with tempfile.TemporaryDirectory() as tmp:
        for name in only:
            try:
                CHECKS[name](Path(tmp))
            except Exception as exc:  # noqa: BLE001 - a crash is a failed check with its traceback
                traceback.print_exc()
                record(f"crashed: {name}", False, error=f"{type(exc).__name__}: {exc}"[:300])
            if args.out:  # a run cut short by its time limit keeps the groups it finished
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(RESULTS, indent=2) + "\n")
    failed = [r["check"] for r in RESULTS if not r["ok"]]
    print(
        f"{len(RESULTS) - len(failed)}/{len(RESULTS)} checks passed"
        + (f"; failed: {failed}" if failed else "")
    )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
