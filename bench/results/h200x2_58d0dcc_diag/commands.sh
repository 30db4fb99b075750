set -uo pipefail
OUT=${OUT:-bench/out}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1 || { echo "editable install failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PAGECOMP_COMMIT=$(cat .commit)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
timeout 200 python3 -m bench.dev_hook_timing --models encoder-1024 --variants uncompressed,speed 2>&1 | tee $OUT/hook_timing_speed.txt | tail -80
timeout 300 python3 -m bench.hf_generate --layers 16 --prompt 12288 --new 64 --batch 8 --variants dynamic_offloaded,compressed --peak-origins --out $OUT/hf_peak_origins.json 2>&1 | tail -5
python3 - <<'P'
import json,os
d=json.load(open(os.environ.get('OUT','bench/out')+'/hf_peak_origins.json'))
for r in d['rows']:
    po=r.get('peak_origins',{})
    print(r['variant'], 'peak', r.get('peak_gpu_gib'), 'prefill', r.get('peak_prefill_gib'), 'trace peak', po.get('peak_bytes'), 'base', po.get('base'), 'events', po.get('trace_events'))
    for k,v in po.get('origins',[]): print('   %12d  %s'%(v,k))
    print('  meta first token', r.get('device_metadata_first_token'), 'end', r.get('device_metadata_split'))
P
