#!/usr/bin/env bash
# Pipeline and training benches with Python's switch interval left alone (PAGECOMP_SWITCH_INTERVAL=0,
# 5 ms) and with pagecomp's default (torch_pagecomp/gil.py), same card, same run.
#   bash bench/dev_switch_interval.sh        (on the GPU machine, after gpu_suite.sh installed wheels)
set -uo pipefail
OUT=${OUT:-bench/out}
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
for si in 0 default; do
    if [ "$si" = default ]; then unset PAGECOMP_SWITCH_INTERVAL; else export PAGECOMP_SWITCH_INTERVAL=$si; fi
    echo "== switch interval: $si"
    timeout 120 python3 -m bench.pipeline_bench --mib 1024 --corpora bf16-randn,mixed --repeats 3 \
        --out "$OUT/pipe_si_$si" 2>&1 | tail -n 6
    timeout 200 python3 -m bench.training_bench --steps 4 --warmup 2 --timeout 60 \
        --variants "${TRAIN_VARIANTS:-none,uncompressed,compressed,compressed_mem}" \
        --out "$OUT/train_si_$si.json" 2>&1 | tail -n 5
    python3 - "$OUT/train_si_$si.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    c = r.get("compressor")
    if c:
        print(f"  {r['variant']}: kernel ms/batch {c['kernel_ms'] / c['batches']:.2f} "
              f"download {c['download_ms'] / c['batches']:.2f} total {c['total_ms'] / c['batches']:.2f} "
              f"restore kernel {c['restore_kernel_ms'] / max(1, c['restore_batches']):.2f}")
PY
done
rm -f "$OUT"/pipe_si_*/*.png
