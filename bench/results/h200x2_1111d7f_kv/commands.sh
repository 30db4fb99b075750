set -uo pipefail
OUT=${OUT:-bench/out}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
here=$PWD
export PYTHONUNBUFFERED=1
FILES_TIMEOUT=200 TEST_FILES="tests/test_integrations.py tests/test_offload_paged.py tests/test_hf_generate_bench.py" bash bench/gpu_suite.sh files 2>&1 | tail -n 6
HF="--layers 16 --prompt 12288 --new 64 --batch 8"
for side in old new; do
  dir=$here; [ $side = old ] && dir=$here/old
  v=compressed; [ $side = new ] && v=dynamic_offloaded,compressed
  (cd $dir && python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1 && \
   PYTHONPATH=/tmp/site:$dir PAGECOMP_COMMIT=$(cat .commit) timeout 200 python3 -m bench.hf_generate $HF --variants $v --out $OUT/hf_$side.json 2>&1 | tail -n 3)
done
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$here PAGECOMP_COMMIT=$(cat .commit)
timeout 200 python3 -m bench.hf_generate $HF --variants dynamic_offloaded,compressed --peak-origins --out $OUT/hf_peak_origins.json 2>&1 | tail -n 3
rm -f $OUT/hf_old.md $OUT/hf_peak_origins.md
python3 - <<'P'
import json,os
o=os.environ.get('OUT','bench/out')
for f in ('hf_old','hf_new','hf_peak_origins'):
    d=json.load(open(f'{o}/{f}.json'))
    for r in d['rows']:
        print(f, d.get('commit'), r['variant'], 'tok/s %.1f'%(r.get('decode_tokens_per_s') or 0), 'prefill %.3f'%(r.get('prefill_s') or 0), 'peak_bytes', round((r.get('peak_gpu_gib') or 0)*2**30), 'prefill_peak', round((r.get('peak_prefill_gib') or 0)*2**30), 'host %.4f'%(r.get('host_gib') or 0), 'meta', r.get('device_metadata_split'), r.get('device_metadata_first_token'), 'counters', {k:(r.get('cache_stats') or {}).get(k) for k in ('prefetched','restored_on_use')})
        po=r.get('peak_origins')
        if po:
            print('   trace peak', po['peak_bytes'], 'base', po['base'])
            for k,v in po['origins']: print('   %12d  %s'%(v,k))
P
STOCK_MODELS=encoder-1024 STOCK_VARIANTS=uncompressed,speed,memory,uncompressed,speed timeout 300 bash bench/gpu_suite.sh stock 2>&1 | tail -n 14
