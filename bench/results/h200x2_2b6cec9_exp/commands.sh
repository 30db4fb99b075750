set -uo pipefail
OUT=${OUT:-bench/out}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1 || { echo "editable install failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PAGECOMP_COMMIT=$(cat .commit)
FILES_TIMEOUT=240 TEST_FILES="tests/test_exp_codec.py tests/test_integrations.py tests/test_offload_paged.py tests/test_api.py" bash bench/gpu_suite.sh files 2>&1 | tail -n 12
echo "== memcheck exp codec"; timeout 150 compute-sanitizer --tool memcheck python3 -m pytest -q -p no:cacheprovider tests/test_exp_codec.py -m "not slow" 2>&1 | grep -E "ERROR SUMMARY|passed|failed" | tail -n 3
timeout 200 python3 -m bench.hf_generate --layers 16 --prompt 12288 --new 64 --batch 8 --variants dynamic_offloaded,compressed,compressed_lz4 --out $OUT/hf_generate.json 2>&1 | tail -n 5
timeout 260 python3 -m bench --mib 128 --corpora gpt-act,gpt-kv,gpt-weights,bf16-randn,bf16-relu,encoder-act --codecs pagecomp,nvcomp --no-png --out $OUT/harness 2>&1 | tail -n 40
ls $OUT $OUT/harness
# 5b0e348
set -uo pipefail
OUT=${OUT:-bench/out}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1 || { echo "editable install failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PAGECOMP_COMMIT=$(cat .commit)
FILES_TIMEOUT=200 TEST_FILES="tests/test_exp_codec.py tests/test_integrations.py" bash bench/gpu_suite.sh files 2>&1 | tail -n 8
timeout 250 python3 -m bench.hf_generate --layers 16 --prompt 12288 --new 64 --batch 8 --variants compressed_lz4,compressed,dynamic_offloaded,compressed --out $OUT/hf_generate.json 2>&1 | tail -n 6
# db22176
set -uo pipefail
OUT=${OUT:-bench/out}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1 || { echo "editable install failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PAGECOMP_COMMIT=$(cat .commit)
FILES_TIMEOUT=200 TEST_FILES="tests/test_exp_codec.py tests/test_offload.py tests/test_offload_paged.py" bash bench/gpu_suite.sh files 2>&1 | tail -n 8
echo "== fuzz"; timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_exp_codec.py -m fuzz --durations=2 2>&1 | tee $OUT/fuzz.txt | tail -n 4
echo "== memcheck"; timeout 150 compute-sanitizer --tool memcheck python3 -m pytest -q -p no:cacheprovider tests/test_exp_codec.py -m "not slow and not fuzz" -k "hostile or gpu_round_trip or misaligned or kernels" 2>&1 | grep -E "ERROR SUMMARY|passed|failed" | tee $OUT/memcheck.txt | tail -n 3
# 9962fe2
set -uo pipefail
OUT=${OUT:-bench/out}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1 || { echo "editable install failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PAGECOMP_COMMIT=$(cat .commit)
timeout 200 python3 -m bench.hf_generate --layers 16 --prompt 12288 --new 64 --batch 8 --variants dynamic,dynamic_offloaded,compressed --out $OUT/hf_generate.json 2>&1 | tail -n 5
