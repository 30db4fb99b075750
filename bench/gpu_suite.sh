#!/usr/bin/env bash
# The GPU machine's one script: GPU tests, sanitizer, benchmarks. Each stage fits one device call:
#   bash bench/gpu_suite.sh tests      # kernel tests + million-page fuzz + compute-sanitizer memcheck
#   bash bench/gpu_suite.sh others     # the rest of the GPU test suite (not slow; OTHERS_WORKERS=4)
#   bash bench/gpu_suite.sh hooks      # the offload and integration GPU tests alone
#   TEST_FILES="tests/a.py tests/b.py" bash bench/gpu_suite.sh files   # those test files (not slow)
#   bash bench/gpu_suite.sh bench      # python -m bench (128 MiB corpora) + pipeline bench
#   bash bench/gpu_suite.sh harness    # the harness beside nvCOMP on HARNESS_CORPORA alone
#                                      # (OLD=dir: that tree too, alternated; HARNESS_ROUNDS)
#   bash bench/gpu_suite.sh training   # activation-offload training step bench
#   bash bench/gpu_suite.sh pipeline   # pipeline bench alone: default, and split (raw share 1)
#   bash bench/gpu_suite.sh offload    # host-write probe + offload GPU tests + stock models
#   bash bench/gpu_suite.sh stock      # the stock-model activation offload benchmark alone
#                                      # (STOCK_ROUNDS=n: each variant n times, alternated)
#                                      # (STOCK_CODEC=auto,lz4: memory/speed once per codec, #23)
#   bash bench/gpu_suite.sh fsdp       # the same under FSDP2 on every GPU (torchrun)
#                                      # (STOCK_HOLD_GROUPS=0 / 1, for stock too: the hooks'
#                                      # held window, a probe; rows record hold_groups)
#                                      # (STOCK_WAIT=1, for stock too: due compressed stores
#                                      # wait for the link, as before 7683f39, a probe; rows
#                                      # record due_stores_wait)
#   bash bench/gpu_suite.sh fsdpab     # FSDP2 on every GPU, the variants interleaved in one
#                                      # torchrun (bench.dev_ab_steps --fsdp --out): JSON rows
#                                      # of the stock schema, gradients checked (STOCK_MODELS,
#                                      # AB_ARMS, AB_ROUNDS, AB_WARMUP (default 4: with 2, the
#                                      # arena still grew and kernels compiled in the timed rounds,
#                                      # bench/results/h200_session63); AB_STALL=S: a step's host part past
#                                      # S seconds prints its stacks, in fsdp_interleaved.txt;
#                                      # AB_SAMPLE=MS: where each arm's host time went, sampled)
#   bash bench/gpu_suite.sh nine       # #21 on one GPU: bench.dev_ab_steps on the nine stock
#                                      # models, a process each, arms interleaved (AB_ARMS,
#                                      # AB_ROUNDS, STOCK_MODELS; NINE_BUDGET: seconds for all,
#                                      # NINE_CAP: for one model, default 150);
#                                      # tables and JSON in $OUT/nine.tgz (the device tool
#                                      # returns 8 files a call); check each table's "model
#                                      # health" line: torch's pinned save_on_cpu makes T5's
#                                      # gradients NaN, and the arms after it (one model)
#                                      # then train on NaN (session 72); each offloading
#                                      # arm settles first (dev_ab_steps --settle) and the
#                                      # collector runs between steps (--gc manual; session 73)
#   bash bench/gpu_suite.sh final      # transformers generation table, stock and deterministic
#   bash bench/gpu_suite.sh lifetimes  # every entry point exits cleanly 20 times (issue #19)
#   bash bench/gpu_suite.sh chaos      # the hooks under random delays on their streams, every
#                                      # step's gradients against no offload (CHAOS_MODELS,
#                                      # CHAOS_ARMS, CHAOS_BUDGET, CHAOS_ARGS; bench/dev_chaos.py)
#   bash bench/gpu_suite.sh crashhunt  # the T5 bench's one illegal memory access in six
#                                      # processes (session 69): processes of HUNT_MODEL with
#                                      # our arms (HUNT_ARMS), each step's arm traced, until
#                                      # one fails or HUNT_BUDGET seconds pass; a failing one is
#                                      # run again from scratch with CUDA_LAUNCH_BLOCKING=1 so
#                                      # the error names its launch. torch's pinned save_on_cpu
#                                      # faults on T5 by itself (bench.dev_save_on_cpu_probe,
#                                      # session 73), so it is not among the default arms
#   bash bench/gpu_suite.sh layout     # saved tensors' layouts (session 73): the hooks' layout
#                                      # tests on the GPU, then bench.dev_sdpa_layout_repro
#                                      # (attention's saved tensors given back contiguous) on
#                                      # each SDPA backend, a process each (a fault ends one)
#   OLD=dir bash bench/gpu_suite.sh ab # stock models at another commit's tree and here, per model
#                                      # (AB_ROUNDS=3: three rounds, the order alternating)
#   bash bench/gpu_suite.sh policy     # probe: offload policies and GPU buffer sizes vs shipped (#21)
#   bash bench/gpu_suite.sh batch      # batched saved tensors: their GPU tests, then memory with and
#                                      # without batches beside uncompressed, interleaved (#21;
#                                      # BATCH_MODELS, BATCH_ROUNDS)
#   bash bench/gpu_suite.sh batchprobe # probe: several saved tensors stored as one slice against
#                                      # one by one, host us a tensor (#21; BATCH_MIB, BATCH_K)
#   bash bench/gpu_suite.sh cputhreads # the CPU path's thread scaling, C loops and python-lz4 (#25;
#                                      # PYTHON_LZ4=0: the C loops only; CPU_PROCS=1: beside
#                                      # the same work in N processes; CPU_SPANS=1: where a
#                                      # threaded call's time goes; CPU_MIB, CPU_THREADS,
#                                      # CPU_REPEATS: timed rounds)
#   bash bench/gpu_suite.sh hold       # the hooks' tests, then steps of the held-storage arms
#                                      # (HOLD_MODELS, HOLD_ARMS, HOLD_ROUNDS, HOLD_WORKERS; #21)
#   bash bench/gpu_suite.sh varlen     # training steps whose sequence length changes every step
#                                      # (dynamic padding; bench/dev_varlen.py, session 78): a
#                                      # process per model (VARLEN_MODELS, VARLEN_ARMS,
#                                      # VARLEN_ROUNDS; VARLEN_CAP: seconds a model, default 120)
#   bash bench/gpu_suite.sh hooktiming # probe: the hooks' host time per call (HOOK_MODELS,
#                                      # HOOK_VARIANTS; #21)
#   bash bench/gpu_suite.sh peakowners # probe: what is live at the step's GPU peak, by the
#                                      # package's function that allocated it (PEAK_MODELS,
#                                      # PEAK_VARIANTS; #21)
#   bash bench/gpu_suite.sh float      # probe: the exponent page codecs' GPU speed and ratio (#23)
#   OLD_KERNELS=dir/triton_kernels bash bench/gpu_suite.sh expab
#                                      # the exponent codec's kernels here against another
#                                      # tree's, bf16 and fp16, at EXP_PAGES (default 4096,
#                                      # 16384, 65536) (#23; bench/dev_exp_encode.py)
#   bash bench/gpu_suite.sh expncu     # the exponent codec's kernels per SASS instruction (#23):
#                                      # ncu's SourceCounters of one encode and one decode on
#                                      # bf16-relu, each mapped by bench/dev_ncu_hot.py
#   bash bench/gpu_suite.sh retune     # probe: prefer="speed"'s retunes step by step, a fixed wait
#                                      # against the doubling one (RETUNE_MODELS, RETUNE_N,
#                                      # RETUNE_STEPS; #21)
#   bash bench/gpu_suite.sh small      # one small call's latency (#26), its primitives' host cost
#                                      # and the tests of the paths it takes (PageCompressor's
#                                      # kernel-only store, the ring)
#   bash bench/gpu_suite.sh native     # probe: a stored slice's driver calls queued by one C call
#                                      # against the store's Python path (#21, session 62), then
#                                      # the hook tests
# Needs the carried wheels in .whl (lz4, nvCOMP) and writes under $OUT (the device tool's folder).
set -uo pipefail
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
# one install at a time: stages started at once (one per GPU) collided here, and one exited
# (bench/results/h200x2_session71, call 5)
exec 9>/tmp/pagecomp_suite_install.lock
flock 9
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
# the package as users install it (the kernels folder maps to torch_pagecomp.kernels)
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1 \
    || { echo "editable install failed"; exit 1; }
flock -u 9
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
# deterministic cuBLAS, for the tests and benches that compare gradients bit for bit (read when
# CUDA starts)
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}
export PAGECOMP_COMMIT=${PAGECOMP_COMMIT:-$(cat .commit 2>/dev/null || echo unknown)}
header() {
    echo "== $1: $(date -u +%FT%TZ) commit $PAGECOMP_COMMIT"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
}
# the whole GPU suite no longer fits one device call: `tests` runs these files, `others` the rest
KERNEL_TESTS="tests/test_triton_compress.py tests/test_triton_decompress.py tests/test_triton_pack.py tests/test_validation.py tests/test_bounds.py"
case "${1:-tests}" in
tests)
    # the kernel files and the fuzz (~210 s on an H100), then memcheck; the rest: stage `others`
    header tests | tee "$OUT/tests.txt"
    timeout 300 python3 -m pytest -q -p no:cacheprovider $KERNEL_TESTS -m "not slow" -rfE \
        --durations=8 2>&1 | tee -a "$OUT/tests.txt" | tail -n 20
    echo "== compute-sanitizer memcheck" | tee -a "$OUT/tests.txt"
    timeout 40 compute-sanitizer --tool memcheck python3 -m bench.dev_decompress_probe \
        --sanitize 2>&1 | tail -n 4 | tee -a "$OUT/tests.txt"
    timeout 40 compute-sanitizer --tool memcheck python3 -m pytest -q -p no:cacheprovider \
        tests/test_triton_compress.py -k "round_trip_all_sizes and (4096 or 65536)" 2>&1 \
        | grep -E "ERROR SUMMARY|passed|failed" | tee -a "$OUT/tests.txt"
    ;;
others)
    header others | tee "$OUT/tests_others.txt"
    # OTHERS_WORKERS=4: pytest-xdist workers sharing the GPU (its wheel carried in .whl)
    timeout 540 python3 -m pytest -q -p no:cacheprovider tests -m "not fuzz and not slow" \
        ${OTHERS_WORKERS:+-n $OTHERS_WORKERS --dist worksteal} \
        $(for f in $KERNEL_TESTS; do echo --ignore "$f"; done) -rfE --durations=8 2>&1 \
        | tee -a "$OUT/tests_others.txt" | tail -n 20
    ;;
hooks)
    # what the activation hooks and the store run on: a check after a change to them
    header hooks | tee "$OUT/tests_hooks.txt"
    timeout ${HOOKS_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider tests/test_offload_paged.py \
        tests/test_offload.py tests/test_offload_tune.py tests/test_integrations.py -m "not slow" \
        -rfE --durations=6 2>&1 | tee -a "$OUT/tests_hooks.txt" | tail -n 20
    ;;
files)
    header files | tee "$OUT/tests_files.txt"
    timeout ${FILES_TIMEOUT:-400} python3 -m pytest -q -p no:cacheprovider ${TEST_FILES:?} -m "not slow" \
        -rfE --durations=6 2>&1 | tee -a "$OUT/tests_files.txt" | tail -n 20
    ;;
bench)
    header bench
    # at most 8 files come back: bench writes 3, the pipeline bench 2 + one timeline per corpus
    timeout 380 python3 -m bench --mib 128 --out "$OUT/bench" 2>&1 > /dev/null | tail -n 4
    cat "$OUT/bench/table.txt"
    timeout 190 python3 -m bench.pipeline_bench --mib 1024 --corpora mixed,bf16-randn,random \
        --repeats 3 --out "$OUT/pipeline" 2>&1 | tail -n 14
    ;;
pipeline)
    header pipeline
    timeout 200 python3 -m bench.pipeline_bench --mib 1024 --corpora mixed,bf16-randn,random \
        --repeats 3 --out "$OUT/pipeline" 2>&1 | tail -n 14
    timeout 150 python3 -m bench.pipeline_bench --mib 1024 --corpora mixed,bf16-randn \
        --max-raw-share 1 --repeats 3 --out "$OUT/pipeline_split" 2>&1 | tail -n 8
    ;;
offload)
    header offload | tee "$OUT/offload.txt"
    [ -n "${SKIP_PROBE:-}" ] || timeout 100 python3 -m bench.dev_host_write_probe --mib 256 2>&1 \
        | tee -a "$OUT/offload.txt"
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_offload_paged.py \
        tests/test_offload.py tests/test_offload_tune.py -rfE -x 2>&1 | tee -a "$OUT/offload.txt" \
        | tail -n 15
    timeout 400 python3 -m bench.stock_models --models "${STOCK_MODELS:-encoder-1024,llama-2048}" \
        --variants "${STOCK_VARIANTS:-none,save_on_cpu,uncompressed,memory,speed}" \
        --codec "${STOCK_CODEC:-auto}" \
        --profile "${STOCK_PROFILE_RUN:-encoder-1024:memory}:$OUT/profile.txt" \
        --out "$OUT/stock_models.json" 2>&1 | tail -n 14
    ;;
stock)
    header stock
    timeout 560 python3 -m bench.stock_models --models "${STOCK_MODELS:-encoder-1024,encoder-2048,llama-2048,resnet-64}" \
        --variants "${STOCK_VARIANTS:-none,save_on_cpu,uncompressed,memory,speed}" \
        --codec "${STOCK_CODEC:-auto}" ${STOCK_ROUNDS:+--rounds $STOCK_ROUNDS} \
        ${STOCK_PROFILE_RUN:+--profile "$STOCK_PROFILE_RUN:$OUT/profile.txt"} \
        --out "$OUT/stock_models.json" 2>&1 | tail -n 24
    ;;
nine)
    header nine | tee "$OUT/nine.txt"
    mkdir -p "$OUT/nine"
    for m in $(echo "${STOCK_MODELS:-llama-2048,hf-llama-2048,encoder-2048,gpt2-768,resnet-64,tv-resnet50,bert-1024,tv-vit-b16,encoder-1024}" | tr , ' '); do
        left=$((${NINE_BUDGET:-560} - SECONDS))
        [ $left -lt 40 ] && { echo "$m: skipped, out of time" | tee -a "$OUT/nine.txt"; continue; }
        [ $left -gt ${NINE_CAP:-150} ] && left=${NINE_CAP:-150}
        timeout $left python3 -m bench.dev_ab_steps --models "$m" \
            --arms "${AB_ARMS:-uncompressed,memory,speed}" --rounds "${AB_ROUNDS:-3}" --warmup 2 \
            --block 4 --out "$OUT/nine/stock_models_one_gpu_$m.json" > "$OUT/nine/one_gpu_$m.txt" 2>&1
        echo "$m rc=$?" | tee -a "$OUT/nine.txt"
        grep -E "^\| [a-z_0-9]+ \| [0-9]" "$OUT/nine/one_gpu_$m.txt" | head -8 | tee -a "$OUT/nine.txt"
    done
    (cd "$OUT/nine" && tar -czf ../nine.tgz .) && rm -rf "$OUT/nine"
    ;;
final)
    # the transformers generation table, then the same with deterministic kernels (#24)
    header final
    timeout 270 python3 -m bench.hf_generate ${HF_ARGS:---layers 16 --prompt 12288 --new 64 --batch 8 --check-kv 4} \
        --out "$OUT/hf_generate.json" 2>&1 | tail -n 8
    timeout 270 python3 -m bench.hf_generate ${HF_ARGS:---layers 16 --prompt 12288 --new 64 --batch 8} \
        --variants dynamic,dynamic_repeat,compressed --deterministic \
        --out "$OUT/hf_generate_deterministic.json" 2>&1 | tail -n 6
    ;;
fsdp)
    header fsdp
    # FSDP2 (fully_shard per block) on every GPU of the machine, one process per GPU; each
    # (model, variant) in its own torchrun, as a user runs one configuration (variants run one
    # after another in one process group ran slower than alone: h200x2_643dbbc_fsdp)
    timeout ${FSDP_TIMEOUT:-540} python3 -m bench.stock_models --fsdp --nproc "$(nvidia-smi -L | wc -l)" \
        --models "${STOCK_MODELS:-encoder-1024,llama-2048}" \
        --variants "${STOCK_VARIANTS:-none,uncompressed,memory,speed}" --codec "${STOCK_CODEC:-auto}" \
        ${STOCK_ROUNDS:+--rounds $STOCK_ROUNDS} \
        --out "$OUT/stock_models_fsdp.json" 2>&1 | tail -n 24
    ;;
fsdpab)
    header fsdpab
    timeout ${FSDP_TIMEOUT:-540} torchrun --standalone --nproc_per_node "$(nvidia-smi -L | wc -l)" \
        -m bench.dev_ab_steps --fsdp --models "${STOCK_MODELS:-encoder-1024,llama-2048}" \
        --arms "${AB_ARMS:-uncompressed,memory,speed,none,save_on_cpu}" --rounds "${AB_ROUNDS:-5}" --warmup "${AB_WARMUP:-4}" \
        ${AB_STALL:+--stall-dump $AB_STALL} ${AB_SAMPLE:+--sample-host $AB_SAMPLE} \
        --out "$OUT/stock_models_fsdp_interleaved.json" 2>&1 | tee "$OUT/fsdp_interleaved.txt" \
        | grep -E "^## |^\| [a-z_0-9]+ \| [0-9]|^speed:"
    ;;
retune)
    header retune | tee "$OUT/retune.txt"
    # the same steps with retunes every RETUNE_N passes (growth 1) and with the doubling wait:
    # the totals differ by what the retunes' pinning and releasing cost
    for g in 1 16; do
        timeout 250 python3 -m bench.dev_step_modes --models "${RETUNE_MODELS:-encoder-2048}" \
            --arm speed --steps "${RETUNE_STEPS:-60}" --warmup 4 --retune "${RETUNE_N:-8}" \
            --growth $g 2>&1 | tee -a "$OUT/retune.txt" | grep "^## "
    done
    ;;
batchprobe)
    header batchprobe | tee "$OUT/batch_offload.txt"
    timeout 200 python3 -m bench.dev_batch_offload --mib "${BATCH_MIB:-1,4,16}" \
        --batch "${BATCH_K:-1,4,16}" 2>&1 | tee -a "$OUT/batch_offload.txt"
    ;;
training)
    header training
    # warm-up 8: prefer="speed" (compressed) times compressed against copied steps in the first 6.
    # 120 s per variant: on a fresh machine the first compressing child compiles every kernel
    # (65 s at b798a19, bench/results/h200_1e001b6/)
    timeout 330 python3 -m bench.training_bench --steps 5 --warmup 8 --timeout 120 \
        --out "$OUT/training_bench.json" 2>&1 | tee "$OUT/training_bench.txt" | tail -n 15
    # partial offload: the last 8 of 12 blocks keep their activations, so copies can hide
    timeout 200 python3 -m bench.training_bench --steps 5 --warmup 8 --timeout 120 \
        --gpu-blocks 8 --prefetch 4 --max-in-flight-mb 4096 \
        --variants none,uncompressed,compressed,compressed_mem \
        --out "$OUT/training_partial.json" 2>&1 | tee "$OUT/training_partial.txt" | tail -n 10
    ;;
ab)
    # before/after on one machine (hosts of one card kind differ by 25% on these steps): the
    # stock bench at the tree in $OLD (another commit, e.g. `git archive REV` unpacked and
    # carried) and at this one, model by model, each installed in turn; one table at the end
    header ab
    [ -d "${OLD:-}" ] || { echo "OLD=<the other commit's tree> is needed"; exit 1; }
    here=$PWD
    mkdir -p "$OUT/ab_parts" && OUT=$(cd "$OUT" && pwd)  # the runs cd into each tree
    # NEW_ARGS: extra stock-bench arguments for this tree only (e.g. --no-phases, to time it
    # the way a tree from before phase_gib does)
    # AB_ROUNDS=n: n rounds, the order alternating (old new, new old, ...): one host's speed
    # drifts by 20-30% within a call (h200_7d64cf1_hostpath), so one pair proves little
    for r in $(seq 1 "${AB_ROUNDS:-1}"); do
    sides="old new"; [ $((r % 2)) = 0 ] && sides="new old"
    for m in $(echo "${STOCK_MODELS:-encoder-1024,resnet-64,llama-2048,encoder-2048}" | tr , ' '); do
        for side in $sides; do
            dir=$here; args=${NEW_ARGS:-}; [ $side = old ] && { dir=$OLD; args=; }
            (cd "$dir" && python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . \
                >/dev/null 2>&1 && PYTHONPATH=/tmp/site:$dir PAGECOMP_COMMIT=$(cat .commit 2>/dev/null \
                || echo $side) timeout 240 python3 -m bench.stock_models --models "$m" \
                --variants "${STOCK_VARIANTS:-uncompressed,memory}" $args \
                --out "$OUT/ab_parts/${side}_${m}_r$r.json" 2>/dev/null | tail -n +3)
        done
    done
    done
    python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1
    python3 - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
rows = []
for path in sorted(glob.glob(f"{out}/ab_parts/*.json")):
    doc = json.load(open(path))
    for r in doc["rows"]:
        name = os.path.basename(path)[:-len(".json")]
        rows.append({**r, "side": name.split("_")[0], "round": int(name.rsplit("_r", 1)[1]),
                     "commit": doc["commit"], "device": doc["device"], "date": doc["date"]})
json.dump({"rows": rows}, open(f"{out}/ab.json", "w"), indent=1)
lines = ["| model | variant | round | side | commit | step ms | host issue ms | host wait ms "
         "| peak GPU GiB | host GiB | stored GiB | pinned held GiB |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|"]
for r in sorted(rows, key=lambda r: (r["model"], r["variant"], r["round"], r["side"] != "old")):
    lines.append(f"| {r['model']} | {r['variant']} | {r['round']} | {r['side']} | {r['commit']} | "
                 f"{r.get('step_ms', 0):.1f} | {r.get('host_issue_ms', 0):.1f} | "
                 f"{r.get('host_wait_ms') or 0:.1f} | "
                 f"{r.get('peak_gpu_gib', 0):.2f} | {r.get('host_gib') or 0:.2f} | "
                 f"{r.get('stored_gib') or 0:.2f} | {r.get('host_held_gib') or 0:.2f} |")
open(f"{out}/ab.md", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
    rm -rf "$OUT/ab_parts"
    ;;
peakowners)
    header peakowners | tee "$OUT/peak_owners.txt"
    timeout 300 python3 -m bench.dev_peak_owners --models "${PEAK_MODELS:-bert-1024}" \
        --variants "${PEAK_VARIANTS:-uncompressed,memory}" 2>&1 | tee -a "$OUT/peak_owners.txt" \
        | tail -n 30
    ;;
varlen)
    # batches whose length changes every step, the arms interleaved (bench/dev_varlen.py)
    header varlen | tee "$OUT/varlen.txt"
    models=${VARLEN_MODELS:-encoder-1024,gpt2-768,bert-1024}
    for m in ${models//,/ }; do
        timeout ${VARLEN_CAP:-120} python3 -m bench.dev_varlen --models "$m" \
            --arms "${VARLEN_ARMS:-none,save_on_cpu,uncompressed,memory,speed}" \
            --rounds "${VARLEN_ROUNDS:-20}" --warmup 2 2>&1 | tee -a "$OUT/varlen.txt"
        echo "$m rc=${PIPESTATUS[0]}" | tee -a "$OUT/varlen.txt"
    done
    ;;
hooktiming)
    # the hooks' host time per call, function by function (bench/dev_hook_timing.py; #21, #26)
    header hooktiming | tee "$OUT/hook_timing.txt"
    timeout ${HOOK_TIMEOUT:-240} python3 -m bench.dev_hook_timing \
        --models "${HOOK_MODELS:-encoder-1024,resnet-64}" \
        --variants "${HOOK_VARIANTS:-uncompressed,memory}" 2>&1 | tee -a "$OUT/hook_timing.txt"
    ;;
float)
    header float
    timeout 300 python3 -m bench.dev_float_codec --mib "${FLOAT_MIB:-128}" 2>&1 | tee "$OUT/float_codec.txt"
    # the window layout beside the table layout, at 2 and 4 warps a page
    timeout 200 python3 -m bench.dev_float_window --mib "${FLOAT_MIB:-128}" 2>&1 | tee "$OUT/float_window.txt"
    timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_dev_float_codec.py \
        tests/test_dev_float_window.py 2>&1 | tail -n 2
    ;;
expab)
    header expab | tee "$OUT/exp_ab.txt"
    [ -d "${OLD_KERNELS:-}" ] || { echo "OLD_KERNELS=<another tree's triton_kernels folder>"; exit 1; }
    for page in $(echo "${EXP_PAGES:-4096,16384,65536}" | tr , ' '); do
        for layout in "" --fp16; do
            echo "== $page-byte pages ${layout:-(bf16)}" | tee -a "$OUT/exp_ab.txt"
            timeout 150 python3 -m bench.dev_exp_encode --trees "old=$OLD_KERNELS" \
                --op encode,decode --page "$page" $layout --rounds 5 2>&1 | tee -a "$OUT/exp_ab.txt"
        done
    done
    ;;
expncu)
    header expncu | tee "$OUT/exp_ncu.txt"
    for k in encode decode; do
        timeout 150 ncu --clock-control none --section SpeedOfLight --section SourceCounters \
            -k "regex:_exp_$k" --launch-skip 1 --launch-count 1 -f -o "$OUT/exp_$k" \
            python3 -m bench.dev_ncu_target bf16-relu --exp >/dev/null 2>&1 || echo "ncu $k failed"
        ncu -i "$OUT/exp_$k.ncu-rep" | grep -E "Duration|Compute \(SM\)" | tee -a "$OUT/exp_ncu.txt"
        ncu -i "$OUT/exp_$k.ncu-rep" --page source --print-source sass --csv > "/tmp/exp_$k.csv"
        gzip -c "/tmp/exp_$k.csv" > "$OUT/exp_${k}_sass.csv.gz"
        python3 -m bench.dev_ncu_hot "/tmp/exp_$k.csv" | tee -a "$OUT/exp_ncu.txt"
    done
    ;;
cputhreads)
    # the CPU path's thread scaling on this host's cores (#25): the C loops, then python-lz4
    # page by page; the table's first line says which loops ran (no compiler: python-lz4 twice)
    header cputhreads
    # --procs: the same work in N processes at once (the host's own limit, without our threads)
    # CPU_SPANS=1: also each thread's loop timed (hand-off, waiting, slowing down)
    timeout ${CPU_TIMEOUT:-200} python3 -m bench.cpu_threads --mib "${CPU_MIB:-128}" \
        --threads "${CPU_THREADS:-1,2,4,8,16}" --host ${CPU_PROCS:+--procs} ${CPU_SPANS:+--spans} \
        ${CPU_REPEATS:+--repeats $CPU_REPEATS} \
        --out "$OUT/cpu_threads.json" 2>&1 | tee "$OUT/cpu_threads.txt"
    [ "${PYTHON_LZ4:-1}" = 0 ] || timeout 200 python3 -m bench.cpu_threads --mib "${CPU_MIB:-128}" \
        --threads 1,2,4,8,16 --python-lz4 --out "$OUT/cpu_threads_python_lz4.json" 2>&1 \
        | tee "$OUT/cpu_threads_python_lz4.txt"
    ;;
native)
    header native | tee "$OUT/native_slice.txt"
    for pages in 16 256; do
        timeout 60 python3 -m bench.dev_native_slice --pages $pages --slices 200 --rounds 5 2>&1 \
            | tee -a "$OUT/native_slice.txt"
    done
    timeout ${HOOKS_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider tests/test_offload_paged.py \
        tests/test_offload.py -m "not slow" -rfE 2>&1 | tee -a "$OUT/native_slice.txt" | tail -n 5
    ;;
small)
    header small | tee "$OUT/tests_small.txt"
    timeout ${SMALL_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider tests/test_direct.py \
        tests/test_pipeline.py -m "not slow" -rfE --durations=4 2>&1 \
        | tee -a "$OUT/tests_small.txt" | tail -n 12
    timeout 120 python3 -m bench.latency --sizes 64K,1M,16M --repeats 100 \
        --out "$OUT/latency.json" 2>&1 | tail -n 45
    # where a call's host time goes: each primitive's cost on this host, now (it drifts), and
    # each function of the API path, timed (#26)
    timeout 60 python3 -m bench.dev_host_floor 2>&1 | tee "$OUT/host_floor.txt"
    timeout 60 python3 -m bench.dev_call_profile --timers --kib 1024 --calls 500 \
        --ops compress,decompress 2>&1 | tee "$OUT/call_timers.txt"
    ;;
harness)
    # the harness beside nvCOMP on a few corpora (a kernel A/B in minutes, not the whole bench);
    # with OLD=<another commit's tree>: both trees, alternated (HARNESS_ROUNDS rounds), one seed
    header harness
    here=$PWD
    mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)  # the runs cd into each tree
    for r in $(seq 1 "${HARNESS_ROUNDS:-1}"); do
    sides="new"; [ -d "${OLD:-}" ] && { sides="new old"; [ $((r % 2)) = 0 ] && sides="old new"; }
    for side in $sides; do
        dir=$here; [ $side = old ] && dir=$OLD
        (cd "$dir" && python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . \
            >/dev/null 2>&1 && PYTHONPATH=/tmp/site:$dir PAGECOMP_COMMIT=$(cat .commit 2>/dev/null \
            || echo $side) timeout ${HARNESS_TIMEOUT:-200} python3 -m bench --codecs pagecomp,nvcomp \
            --corpora "${HARNESS_CORPORA:-periodic,mixed,text,bf16-relu,encoder-act}" --mib 128 \
            --seed "${HARNESS_SEED:-7}" --no-png --out "/tmp/harness_${side}_r$r" >/dev/null 2>&1
        cp "/tmp/harness_${side}_r$r/results.json" "$OUT/harness_${side}_r$r.json"
        echo "== $side, round $r ($(cat .commit 2>/dev/null))"
        grep -E "^[a-z0-9-]+ +(pagecomp|nvcomp lz4)" "/tmp/harness_${side}_r$r/table.txt" | cut -c1-100)
    done
    done
    if [ -d "${OLD:-}" ]; then  # this tree installed again, as the other stages expect
        python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1
    fi
    ;;
policy)
    header policy
    timeout 540 python3 -m bench.dev_offload_policy --models "${STOCK_MODELS:-encoder-1024,llama-2048}" \
        --variants "${STOCK_VARIANTS:-uncompressed,memory}" --policies "${POLICIES:-shipped,keep,slice32,scratch1,restore32}" \
        --out "$OUT/offload_policy.json" 2>&1 | tail -n 24
    ;;
batch)
    header batch | tee "$OUT/batch.txt"
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_offload_batch.py \
        tests/test_checksum.py tests/test_ledger.py -m "not slow" -rfE 2>&1 | tee -a "$OUT/batch.txt" \
        | tail -n 6
    timeout 400 python3 -m bench.dev_ab_steps \
        --models "${BATCH_MODELS:-encoder-1024,resnet-64,tv-resnet50,bert-1024,gpt2-768}" \
        --arms uncompressed,memory,memory_single --rounds "${BATCH_ROUNDS:-8}" --warmup 2 2>&1 \
        | tee -a "$OUT/batch.txt" | grep -v "^|---"
    ;;
hold)
    # the last groups held for the backward (_batch): the hooks' tests, then the variants
    # interleaved; HOLD_ARMS (default: memory beside memory_wait, its due stores waiting for the
    # link as before; *_nohold: nothing held)
    header hold | tee "$OUT/hold.txt"
    timeout ${HOLD_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider tests/test_offload_hold.py \
        tests/test_offload_batch.py tests/test_offload.py tests/test_offload_paged.py \
        tests/test_offload_tune.py tests/test_checksum.py tests/test_ledger.py \
        tests/test_stock_models.py tests/test_integrations.py -m "not slow" \
        ${HOLD_WORKERS:+-n $HOLD_WORKERS --dist worksteal} -rfE 2>&1 | tee -a "$OUT/hold.txt" \
        | tail -n 6
    timeout ${HOLD_AB_TIMEOUT:-400} python3 -m bench.dev_ab_steps \
        --models "${HOLD_MODELS:-encoder-1024,resnet-64,tv-resnet50,bert-1024,encoder-2048,llama-2048}" \
        --arms "${HOLD_ARMS:-uncompressed,memory,memory_wait,none}" \
        --rounds "${HOLD_ROUNDS:-8}" --warmup 2 2>&1 | tee -a "$OUT/hold.txt" | grep -v "^|---"
    ;;
layout)
    header layout | tee "$OUT/layout.txt"
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_offload.py -k layout \
        -rfE 2>&1 | tail -n 4 | tee -a "$OUT/layout.txt"
    for backend in ${LAYOUT_BACKENDS:-efficient math}; do  # (cuDNN takes no such bias, session 74)
        timeout 60 python3 -m bench.dev_sdpa_layout_repro --backend "$backend" 2>&1 \
            | grep -vE "^ +File|^Traceback" | tail -n 6 | tee -a "$OUT/layout.txt"
        echo "$backend rc=${PIPESTATUS[0]}" | tee -a "$OUT/layout.txt"
    done
    ;;
crashhunt)
    header crashhunt | tee "$OUT/crashhunt.txt"
    hunt=(python3 -m bench.dev_ab_steps --models "${HUNT_MODEL:-t5-1024}" --rounds 3 --warmup 2
          --block 4 --trace --arms "${HUNT_ARMS:-none,uncompressed,memory,speed}")
    run=0
    while [ $SECONDS -lt $(( ${HUNT_BUDGET:-420} - 90 )) ]; do
        run=$((run + 1))
        log="$OUT/crashhunt_$run.txt"
        timeout 150 "${hunt[@]}" > "$log" 2>&1
        rc=$?
        echo "run $run rc=$rc, last step: $(grep '^\[ab\]' "$log" | tail -n 1)" | tee -a "$OUT/crashhunt.txt"
        if [ $rc -ne 0 ] && [ $rc -ne 124 ]; then
            grep -m 3 -E "Error|error" "$log" | tee -a "$OUT/crashhunt.txt"
            CUDA_LAUNCH_BLOCKING=1 timeout 240 "${hunt[@]}" > "$OUT/crashhunt_blocking.txt" 2>&1
            echo "blocking rc=$?" | tee -a "$OUT/crashhunt.txt"
            grep -B 40 -m 1 -E "AcceleratorError|illegal" "$OUT/crashhunt_blocking.txt" \
                | grep -E '^\[ab\]|File|Error' | tail -n 16 | tee -a "$OUT/crashhunt.txt"
            break
        fi
        [ $rc -eq 0 ] && rm -f "$log"  # (the device tool returns few files: keep the failures')
    done
    ;;
chaos)
    # the hooks' stream order under random GPU delays (bench/dev_chaos.py): a process per
    # model of CHAOS_MODELS, CHAOS_BUDGET seconds for all, CHAOS_EACH at most for one; CHAOS_ARGS passed on (--control:
    # hand-offs dropped, which must show differing gradients; --sdpa default)
    header chaos | tee -a "$OUT/chaos.txt"
    for m in $(echo "${CHAOS_MODELS:-t5-1024}" | tr , ' '); do
        left=$((${CHAOS_BUDGET:-400} - SECONDS))
        [ $left -lt 60 ] && { echo "$m: skipped, out of time" | tee -a "$OUT/chaos.txt"; continue; }
        [ $left -gt ${CHAOS_EACH:-400} ] && left=${CHAOS_EACH:-400}
        log="$OUT/chaos_$m${CHAOS_TAG:-}.txt"
        timeout $left python3 -m bench.dev_chaos --models "$m" --arms "${CHAOS_ARMS:-uncompressed,memory,speed}" \
            --steps "${CHAOS_STEPS:-500}" --budget $((left - 45)) ${CHAOS_ARGS:-} > "$log" 2>&1
        rc=$?
        echo "$m ${CHAOS_ARGS:-} rc=$rc, last step: $(grep '^\[chaos\]' "$log" | tail -n 1)" | tee -a "$OUT/chaos.txt"
        grep -v '^\[chaos\]' "$log" | grep -E "seed|differ|rounds of|Error|error" | head -n 12 | tee -a "$OUT/chaos.txt"
        [ $rc -eq 0 ] && rm -f "$log"
    done
    ;;
lifetimes)
    # tests/test_lifetimes.py -m slow: each exit script 20 times on the CPU and the GPU, and the
    # FSDP2 bench on two ranks under torchrun 20 times (gloo; NCCL with two GPUs). Most of a run
    # is starting an interpreter: one script per core, one torchrun (two ranks) per 4 cores.
    header lifetimes | tee "$OUT/lifetimes.txt"
    export PAGECOMP_EXIT_WORKERS=${PAGECOMP_EXIT_WORKERS:-$(nproc)}
    export PAGECOMP_TORCHRUN_WORKERS=${PAGECOMP_TORCHRUN_WORKERS:-$(( $(nproc) > 7 ? $(nproc) / 4 : 1 ))}
    # compile the kernels once, so that the parallel first runs load them from Triton's cache
    timeout 120 python3 -c '
import torch, torch_pagecomp
x = torch.randint(0, 4, (16 * 4096,), dtype=torch.uint8, device="cuda")
assert torch.equal(torch_pagecomp.decompress(torch_pagecomp.compress(x)).view(-1), x)
with torch_pagecomp.PageCompressor() as comp:
    y = torch.randn(1 << 22, device="cuda")
    assert torch.equal(comp.restore(comp.offload(y)), y)
lin = torch.nn.Linear(256, 256).cuda()
for kw in (dict(prefer="memory"), dict(prefer="speed")):
    with torch_pagecomp.offload_activations(min_offload_bytes=0, **kw):
        loss = lin(torch.randn(512, 256, device="cuda")).relu().square().sum()
    loss.backward()
print("kernels warm")' 2>&1 | tee -a "$OUT/lifetimes.txt"
    timeout 420 python3 -m pytest -q -p no:cacheprovider tests/test_lifetimes.py -m slow -rfE \
        --durations=12 2>&1 | tee -a "$OUT/lifetimes.txt" | tail -n 40
    ;;
esac
