#!/usr/bin/env bash
# Compare two versions of the code on the GPU: the same benchmark command run in a worktree at REV ("a") and in
# this checkout ("b"), in interleaved rounds (a, b, a, b, ...), so that a drift of the machine falls on both.
# Run from the repository root on the GPU machine; REV is a commit of this git checkout (checked out into a
# temporary worktree) or a directory that holds the other version:
#
#     OUT=$OUT ROUNDS=3 bash bench/ab_commits.sh REV -- python3 bench/bench_gpu.py --variants bf16,fp8 \
#         --contexts 512 --steps 24 --no-peer --prefill-variants none --chunks "" --out {out}
#
# "{out}" in the command becomes $OUT/a-N.json or $OUT/b-N.json (round N); each run's output goes to the same
# name with .log. The last lines summarise each run's exit status; compare the JSON files for the figures.
set -o pipefail
OUT=${OUT:-/tmp/ds4serve-ab}
ROUNDS=${ROUNDS:-3}
if [ $# -lt 3 ] || [ "$2" != "--" ]; then
    echo "usage: bash bench/ab_commits.sh REV -- COMMAND [ARGS ...]   ({out} in the arguments: a per-run file)" >&2
    exit 2
fi
rev=$1
shift 2
mkdir -p "$OUT"
here=$(pwd)
if [ -d "$rev" ]; then
    other=$(cd "$rev" && pwd)
else
    other=$(mktemp -d /tmp/ds4serve-ab-XXXXXX)
    git worktree add --detach "$other" "$rev" >/dev/null || exit 2
    trap 'git -C "$here" worktree remove --force "$other"' EXIT
fi
[ -f bench/device_env.sh ] && . bench/device_env.sh
echo "a: $rev ($other)"
echo "b: $(git log -1 --format='%h %s' 2>/dev/null || echo "$here")"
for round in $(seq 1 "$ROUNDS"); do
    for side in a b; do
        dir=$here
        [ "$side" = a ] && dir=$other
        out="$OUT/$side-$round.json"
        args=()
        for arg in "$@"; do args+=("${arg//\{out\}/$out}"); done
        (cd "$dir" && PYTHONPATH="$dir${PYTHONPATH:+:$PYTHONPATH}" "${args[@]}") > "${out%.json}.log" 2>&1
        echo "round $round $side exit $?: ${out%.json}.log"
    done
done
