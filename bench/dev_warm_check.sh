#!/usr/bin/env bash
# Does a GPU machine that just ran the GPU suite give slower compressed training steps? (One run
# at 789512d did: bench/results/h200_f7097f2/README.md.) In one device call: GPU state, training
# step (uncompressed, compressed_mem) on the fresh machine, the GPU suite's tests stage, then the
# same training step again. Writes warm_before.json / warm_after.json under $OUT.
set -uo pipefail
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PAGECOMP_COMMIT=${PAGECOMP_COMMIT:-$(cat .commit)}
q() {
    nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw,clocks_throttle_reasons.active \
        --format=csv,noheader
    free -g | sed -n 2p
}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
step() {
    timeout 120 python3 -m bench.training_bench --steps 5 --warmup 8 --timeout 60 \
        --variants uncompressed,compressed_mem --out "$OUT/$1.json" 2>&1 | tail -n 3
}
echo "== fresh"; q
step warm_before
echo "== GPU suite (tests stage)"
bash bench/gpu_suite.sh tests > /dev/null 2>&1
grep -E "passed|failed" "$OUT/tests.txt" | head -3
rm -f "$OUT/tests.txt"
q
step warm_after
q
