"""The decode optimisations that one benchmark run compares, each switchable on its own.

Off means the behaviour of the previous GPU round, so that a single device call can time every
combination in one process (``bench/bench_gpu.py --arms``). The defaults are what the 2026-11-29 runs
found fastest among the configurations that passed the GPU checks (bench/RESULTS.md). The GEMV's tiles and
split-K are per shape (``kernels/gemv.py`` ``TABLE``, swept by ``bench/sweep_gemv.py``), not a switch.
"""

from __future__ import annotations

import dataclasses
import re
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator


@dataclass
class Switches:
    # Each decoder block of a static step is one compiled region; the Triton kernels are custom ops
    # inside it (kernels/ops.py), so Inductor fuses everything elementwise between them.
    block_regions: bool = True
    # Dense bf16 projections of a few rows run as the Triton GEMV (kernels/gemv.py) instead of cuBLAS.
    gemv_dense: bool = True
    # The static step's attention over the window (and entries) is the fused Triton decode attention
    # (kernels/decode_attention.py, two launches) instead of the cat, two products and the softmax.
    decode_attention: bool = True
    # The decode graph's commit (SequenceState.write_token) is one row-scatter launch (kernels/commit.py).
    commit_kernel: bool = True
    # Inductor's horizontal fusion (``combo_kernels``): independent small kernels of a compiled region
    # share one launch (bf16 decode at 512: 11.72 -> 10.98 ms/token on the H200, 2026-11-29).
    combo_kernels: bool = True
    # The router's gate product of a decode step runs as the Triton GEMV instead of cuBLAS (F.linear:
    # a split-K kernel and its reduce per layer); at 512: bf16 11.02 -> 10.95, FP8 8.52 -> 8.45 ms/token.
    router_gemv: bool = True
    # hc_merge's 4x4 stream mix of a decode step is a product-sum that Inductor fuses with the merge,
    # instead of a cuBLAS batched matmul per site; at 512: bf16 11.02 -> 10.72, FP8 8.52 -> 8.24 ms/token
    # (H200, 2026-11-29, bench/results/2026-11-29-h200-round6-arms.log).
    merge_product_sum: bool = True
    # Regions marked chunks=True (norms, RoPE, the mHC mixes) also run compiled (dynamic shapes) in
    # prefill and verify chunks on CUDA (kernels/regions.py). bf16 proxy, one 2048-token prefill chunk:
    # 7,441 -> 10,284 tok/s (25.1% -> 34.7% of the matmul rate; H200, 2026-11-29,
    # bench/results/2026-11-29-h200-round9-ab.*).
    chunk_regions: bool = True
    # Speculative decoding on CUDA runs as CUDA graphs: each verify width (engine/cuda_graphs.py
    # VerifyGraph: the static block forward, then commit_static of the accepted prefix) and the MTP /
    # DSpark draft passes (engine/draft_graphs.py) instead of eager forwards. check_gpu.py 62/62 with
    # them; on the bf16 proxy a verify step of width 2 takes 19 ms through the graphs against 182 ms
    # eagerly (bench/spec_gpu.py, H200, 2026-11-29, bench/results/2026-11-29-h200-round7-spec.log).
    speculative_graphs: bool = True
    # Chunk forwards (prefill) dequantise FP8 / MXFP4 weights in one Triton pass (kernels/dequant.py)
    # instead of the torch chain, and a chunk's quantized routed experts run as grouped GEMMs over
    # groups of experts dequantised together (model/moe_grouped.py) instead of expert by expert.
    # FP8+MXFP4 proxy, 2048-token chunk: 1,111 -> 3,729 tok/s; tiny fp8+fp4 logits within 1.1e-6 of
    # the CPU (H200, 2026-11-29, bench/results/2026-11-29-h200-round8-*).
    dequant_kernel: bool = True
    # A verify graph's accepted prefix is committed by device writes at the block's device positions,
    # captured once per accepted count (VerifyGraph.commit -> SequenceState.write_block: two launches
    # of the commit kernel per token), instead of commit_static's eager writes. bf16 proxy, oracle
    # drafts: width 2 63.4 -> 84.7 tok/s, width 4 51.1 -> 68.0 (same tokens per verify step); check_gpu
    # passed with it, twice (H200, 2026-11-29, bench/results/2026-11-29-h200-round8-spec.log).
    static_commit: bool = True
    # Speculative verify steps of a layer split in one process run as one CUDA graph per shard
    # (engine/cuda_graphs.py SplitVerifyGraph), and plain decoding over a multi-process pipeline as one
    # per rank (parallel/pipeline.py PipelineDecodeGraph); otherwise those steps are eager. Full-size
    # Flash shape (256 experts, FP8+MXFP4) on two H200s: split speculative width 2 at p 0.9 7.46 ->
    # 131.4 tok/s, pipeline plain decoding 4.84 -> 95.2 tok/s, greedy tokens of the split and the
    # pipeline identical (bench/two_gpu.py, 2026-11-29, bench/results/2026-11-29-h200x2-graphs-*).
    split_verify_graphs: bool = True
    pipeline_graphs: bool = True
    # A multi-process pipeline's speculative verify steps as one CUDA graph per rank (parallel/pipeline.py
    # PipelineVerifyGraph; with static_commit). Full-size Flash shape (FP8+MXFP4, 256 experts) on two H200s,
    # oracle drafts at p 0.9: width 2 6.5 -> 118.1 tok/s, width 4 9.6 -> 126.0 (plain decoding 101.8);
    # exactness checked on CPU (gloo, graphs uncaptured: logits and tokens equal the single device's)
    # (bench/two_gpu.py, 2026-11-30, bench/results/2026-11-30-h200x2-round11-pipeline-verify-*).
    pipeline_verify_graphs: bool = True
    # Hand-written and Inductor kernels are launched with programmatic dependent launch (kernels/pdl.py):
    # each may be scheduled while the one before it runs, and waits for it before touching memory. At
    # 512: bf16 10.70 -> 10.15, FP8 8.22 -> 7.55 ms/token; check_gpu passed with it (H200, 2026-11-29,
    # bench/results/2026-11-29-h200-round8-*).
    pdl: bool = True
    # Each mHC boundary of a decode-sized chunk is one launch (kernels/hc_pre.py): a pre site (the RMS, the
    # 24 mixes, the Sinkhorn coefficients, the collapse and the sublayer's input norm) instead of four, with
    # the merge of the sublayer output before it (hc_merge_pre) instead of about ten; a block's closing merge
    # joins the next block's first site, which also sums the fused MoE's slot terms (model/deepseek4.py).
    # The merge kernels run without FP contraction (kernels/hc_streams.py EXACT_ROUNDING). Interleaved A/B
    # at 512 / 8192: bf16 9.80 -> 9.33 / 10.28 -> 9.81, FP8 6.99 -> 6.54 / 7.46 -> 6.97 ms/token; check_gpu
    # (kernels, tiny, graphs, verify graphs) 83/83 with it (H200, 2026-11-30,
    # bench/results/2026-11-30-h200-round12-hcfused-*).
    hc_fused: bool = True
    # A static step's CSA attention reads only the entries the indexer selected, named by index slots
    # (kernels/indexer.py select_top_indices, kernels/decode_attention.py), instead of every entry tile
    # that holds a selected one under a mask (at 32K context 512 of 8192 entries are selected, and a
    # mask still visits nearly every 32-entry tile). Interleaved A/B at 512 / 8192 / 32768 context:
    # bf16 9.96 -> 9.96 / 10.51 -> 10.50 / 11.86 -> 11.46, FP8 7.32 -> 7.34 / 7.82 -> 7.81 / 9.21 -> 8.81
    # ms/token; check_gpu passed with it (H200, 2026-11-29, bench/results/2026-11-29-h200-round10-*).
    gather_entries: bool = True
    # The MoE router of a decode step (at most 16 rows, dense gate) is one launch (kernels/router.py: the gate
    # product split over ~256 programs, the last of which computes the scores, the top-k and the weights)
    # instead of six (the GEMV, its split sum and four Inductor kernels) per layer. Interleaved A/B at 512:
    # bf16 10.10 -> 9.79, FP8 7.61 -> 7.28 ms/token; its GPU tests and check_gpu passed with it (H200,
    # 2026-11-29, bench/results/2026-11-29-h200x2-round10-router-*).
    router_fused: bool = True
    # A layer's two input products of a decode step (FP8 ``wq_a``+``wkv`` and the bf16 compressor and indexer
    # weights, model/projections.py) run in one launch (kernels/gemv.py gemv_pair) instead of two, where
    # both products' tiles are CUDA-core tiles without split-K. At 512: FP8 7.17 -> 7.04 ms/token (6.87 ->
    # 6.71 with hc_fused; bf16 has one input product, unchanged); the pair kernel's outputs equal the two
    # launches' bit for bit at the real shapes (H200, 2026-11-30, bench/results/2026-11-30-h200-round11-fused-*).
    gemv_pair: bool = True
    # A prefill chunk's RoPE of the query and of the attention output is written into the tensor's rotated
    # channels (model/rope.py Rope.apply_in_place) instead of a concatenation that rewrites every channel of
    # the ``[S, 64, 512]`` tensor; the values are the same. Decode and verify steps are unchanged. 4-layer bf16
    # proxy, one chunk from position 0, arms in one process: 8192 tokens 66.1 -> 61.0 / 61.5 ms; chunks of 512
    # and 2048 tokens are bound by the host and did not change; the kernels of a 2048-token chunk 16.56 -> 15.65
    # ms (H200, 2026-11-30, bench/results/2026-11-30-h200-round16-{d,e}-*).
    rope_in_place: bool = True
    # A prefill chunk's mHC mixes are one Triton launch over the bf16 streams on tensor cores
    # (kernels/hc_streams.py hc_mixes) instead of an fp32 copy of the normalised streams and cuBLAS's fp32 GEMM.
    # One site of the proxy (bench/sweep_mixes.py): 350 -> 206 us at 2048 tokens, 644 -> 206 us at 8192;
    # check_gpu.py --only tiny 5/5 with it (H200, 2026-11-30, bench/results/2026-11-30-h200-round17-*).
    chunk_mix_kernel: bool = True
    # A prompt's first prefill chunk (position 0, up to 2048 tokens, bf16 experts) is replayed as a CUDA graph
    # per length bucket, padded to it (engine/prefill_graphs.py), instead of launched kernel by kernel from the
    # host, which bounds such chunks. 43-layer bf16 proxy, whole prompts through Engine.prefill: 512 tokens
    # 367.3 -> 99.7 ms, 2048 tokens 360.3 -> 190.5 ms, the same logits (H200, 2026-11-30,
    # bench/results/2026-11-30-h200-round17-e-*).
    prefill_graphs: bool = True
    # A chunk's quantized (FP8 / MXFP4) routed experts run as grouped GEMMs that read the experts in place and
    # dequantise tiles in registers (kernels/grouped_experts.py: a gate-up launch with the SwiGLU fused and a down
    # launch, no host read of the group ends) instead of dequantising groups of experts to dense copies
    # (dequant_kernel), in captured chunks and where the groups are short (model/moe_grouped.py); the
    # first-chunk graphs (prefill_graphs) then take quantized models too. FP8+MXFP4 proxy (43 layers), whole
    # prompts: 512 tokens 412.3 -> 151.8 ms, 2048 tokens 502.3 -> 324.7 ms; 6 layers of the Flash shape (256
    # experts): 2048 tokens 336.2 -> 67.4 ms, 8192 tokens 701.3 -> 230.4 ms; the same last logits (H200,
    # 2026-11-30, bench/results/2026-11-30-h200-round18-d-prefill-*).
    quant_grouped_mm: bool = True
    # A layer split in one process gets the first-chunk graphs too: one graph per shard and bucket, replayed in
    # layer order with the streams copied between them (engine/prefill_graphs.py). Full Flash shape (43 layers,
    # 256 experts, FP8+MXFP4) split over two H200s, whole prompts through Engine.prefill: 512 tokens 417.5 ->
    # 218.4 ms, 2048 tokens 440.7 -> 415.1 ms, the same last logits; its CUDA test passed on the two GPUs
    # (2026-11-30, bench/results/2026-11-30-h200x2-round19-c-*).
    split_prefill_graphs: bool = True
    # A multi-process pipeline's first prefill chunks as one graph per rank and bucket (parallel/pipeline.py
    # PipelineFirstChunks): the padded chunk's streams go rank to rank as in a forward. Full Flash shape (43 layers,
    # 256 experts, FP8+MXFP4) over two H200s, one process each, whole prompts through Engine.prefill: 512 tokens
    # 319.6 -> 206.9 ms, 2048 tokens 403.2 -> 393.1 ms, the same last logits (2026-11-30,
    # bench/results/2026-11-30-h200x2-round20-a-*); CPU test (gloo, uncaptured) exact against one device.
    pipeline_prefill_graphs: bool = True
    # The grouped experts' MXFP4 tiles decoded by the fused MoE's integer multiply (kernels/moe.py _e2m1) instead
    # of kernels/dequant.py's helpers: the same values in about a third of the operations (sm_90, Triton 3.6, a
    # 64x64x128 gate-up tile: 9,675 SASS instructions against 15,054, no spills). Exact for group exponents up
    # to 192, as the decode MoE (tests: every code). Whole prompts (bench/prompt_prefill.py --variant fp8+fp4):
    # 43-layer proxy 512 tokens 151.2 -> 132.1 ms, 2048 tokens 319.1 -> 282.5; 6 layers of the Flash shape (256
    # experts) 2048 tokens 66.0 -> 54.1, 8192 tokens 230.1 -> 184.2; the same last logits (H200, 2026-11-30,
    # bench/results/2026-11-30-h200-round19-b-fp4bits.log).
    grouped_fp4_bits: bool = True
    # A one-token static step's query and key norms, their RoPE and the window keys are one launch
    # (kernels/attention_inputs.py) instead of ~six Inductor kernels per layer. Interleaved A/B at 512, five
    # rounds: bf16 9.27 -> 9.16, FP8 6.56 -> 6.44 ms/token; check_gpu (graphs, verify graphs) 7/7 with it (H200,
    # 2026-12-01, bench/results/2026-12-01-h200-round24-e-*). The inverse RoPE folded into the decode attention's
    # combine as well was slower for FP8 (6.57 -> 6.87 alone; round24-d) and was not kept.
    attention_inputs: bool = True
    # Each row of a fused mHC site (kernels/hc_pre.py) has one more program, which waits for the row's partials
    # and runs the Sinkhorn iterations for post and comb while the last program to arrive collapses the streams
    # and applies the norm with pre alone; without it the last program does both, one after the other.
    # Interleaved A/B at 512, five rounds: bf16 9.12 -> 9.07, FP8 6.41 -> 6.38 ms/token; check_gpu (graphs,
    # verify graphs) 15/15 with it (H200, 2026-12-01, bench/results/2026-12-01-h200-round25-c-*).
    hc_sinkhorn_program: bool = True
    # A fused mHC site's programs load their columns of fn (the mixes' weights, 1.5 MB a site) before their PDL
    # wait, so that the phase's one trip to DRAM overlaps the kernel before it (kernels/hc_pre.py). Interleaved A/B
    # at 512, five rounds: bf16 9.02 -> 8.97, FP8 6.32 -> 6.30 ms/token (every round; H200, 2026-12-01,
    # bench/results/2026-12-01-h200-round25-d-*).
    hc_fn_before_wait: bool = True
    # The one-launch router's programs read the first step of their gate rows (at the proxy's and the Flash model's
    # sizes, half or all of their slice) before their PDL wait (kernels/router.py), as the mHC sites read fn.
    # Interleaved A/B at 512, five rounds: FP8 6.38 -> 6.34 (every round), bf16 9.02 -> 9.01 ms/token (H200,
    # 2026-12-01, bench/results/2026-12-01-h200-round25-e-*).
    router_gate_before_wait: bool = True


SWITCHES = Switches()
NAMES = tuple(f.name for f in dataclasses.fields(Switches))


def parse(spec: str) -> dict[str, bool]:
    """Every switch's value for a benchmark's switch set: ``base`` (all off), ``all`` (all on),
    ``defaults`` (as shipped), names joined by ``+`` (those on, the rest off), or ``defaults+NAME+...``
    (the defaults with those on as well); ``-NAME`` after a name turns that switch off
    (``defaults-pdl``, ``defaults+gather_entries-pdl``)."""
    if spec in ("base", "all"):
        return dict.fromkeys(NAMES, spec == "all")
    terms = re.findall(r"([+-]?)([^+-]+)", spec)
    start = Switches() if terms[:1] == [("", "defaults")] else Switches(**dict.fromkeys(NAMES, False))
    changes = terms[1:] if terms[:1] == [("", "defaults")] else terms
    unknown = {name for _, name in changes} - set(NAMES)
    if unknown:
        raise ValueError(f"unknown switches {sorted(unknown)}; expected names of {list(NAMES)}")
    values = {n: getattr(start, n) for n in NAMES}
    values.update((name, sign != "-") for sign, name in changes)
    return values


@contextmanager
def using(**changes: bool) -> Iterator[Switches]:
    """Set some switches inside this scope (A/B runs, tests); unknown names are an error."""
    unknown = set(changes) - set(NAMES)
    if unknown:
        raise ValueError(f"unknown switches: {sorted(unknown)}")
    previous = dataclasses.replace(SWITCHES)
    for name, value in changes.items():
        setattr(SWITCHES, name, value)
    try:
        yield SWITCHES
    finally:
        for name in NAMES:
            setattr(SWITCHES, name, getattr(previous, name))
