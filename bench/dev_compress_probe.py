"""Dev probe for the Triton LZ4 compressor: correctness and speed on realistic 128 MiB batches.

Run on the GPU machine (lz4 on PYTHONPATH):
``python3 bench/dev_compress_probe.py [--sweep] [--candidates MODE] [--only-sweep]``.
Checks every page (lz4 decode, shuffle, FILL/RAW rules), then prints GB/s (uncompressed bytes
over the do_bench median) and the ratio beside python-lz4's (cpu_codec, same page rules) on a
sample of the same pages.
"""

from __future__ import annotations

import argparse
import glob
import random
import sys
import sysconfig
import time
from pathlib import Path

import lz4.block
import numpy as np
import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from torch_pagecomp import cpu_codec  # noqa: E402
from torch_pagecomp import format as fmt  # noqa: E402
from torch_pagecomp.kernels import lz4_compress as lc  # noqa: E402
from torch_pagecomp.shuffle import bitshuffle  # noqa: E402

P = 4096
NBYTES = 128 << 20 if torch.cuda.is_available() else 2 * P
N = NBYTES // P
SAMPLE = min(4096, N)
# (candidates, near, programs_per_sm, window, extra_words, hash_bits, num_warps); the first is
# the default. Programs keep their hash tables in L2: hash_bits 10 halves a table, so more
# programs per SM fit the same footprint (the sweep at 77473c3 had 32 per SM 2-3x slower at 11)
SWEEP = [
    ("store-max", 4, 16, 128, 2, 11, 1), ("store-max", 4, 16, 128, 2, 10, 1),
    ("store-max", 4, 24, 128, 2, 10, 1), ("store-max", 4, 32, 128, 2, 10, 1),
    ("store-max", 4, 24, 128, 2, 11, 1), ("store-max", 4, 12, 128, 2, 11, 1),
    ("store-max", 4, 16, 256, 2, 11, 1), ("store-max", 4, 8, 128, 2, 11, 2),
]


def _files(patterns, per_file, total, seed):
    files = sorted({f for p in patterns for f in glob.glob(p, recursive=True)})
    random.Random(seed).shuffle(files)
    buf = bytearray()
    for f in files:
        try:
            data = Path(f).read_bytes()[:per_file]
        except OSError:
            continue
        buf += data[: len(data) // P * P]
        if len(buf) >= total:
            break
    print(f"  read {len(buf) >> 20} MiB from {len(files)} candidate files", flush=True)
    while len(buf) < total:
        buf += buf[: total - len(buf)]
    return torch.frombuffer(bytearray(buf[:total]), dtype=torch.uint8).view(-1, P)


def corpora():
    std, pure = sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"]
    text = _files([f"{std}/**/*.py", f"{pure}/**/*.py"], 1 << 20, NBYTES, 1)
    so_globs = ["/usr/lib/x86_64-linux-gnu/*.so*", f"{pure}/**/*.so*", f"{std}/**/*.so*"]
    libs = _files(so_globs, 2 << 20, NBYTES, 2)
    g = torch.Generator().manual_seed(3)
    pick = torch.randint(0, N, (N,), generator=g)
    which = torch.rand(N, generator=g)
    mixed = torch.where((which < 0.65).unsqueeze(1), text[pick], libs[pick])
    mixed[which < 0.30] = 0
    randn = torch.randn(NBYTES // 2, generator=g).to(torch.bfloat16).view(torch.uint8).view(-1, P)
    relu = torch.relu(torch.randn(NBYTES // 2, generator=g)).to(torch.bfloat16)
    relu = relu.view(torch.uint8).view(-1, P)
    rand = torch.randint(0, 256, (N, P), dtype=torch.uint8, generator=g)
    zeros = torch.zeros((N, P), dtype=torch.uint8)
    return {
        "text": (text, 1), "so": (libs, 1), "mixed": (mixed, 1), "bf16-randn": (randn, 1),
        "bf16-relu": (relu, 1), "bf16-randn E2": (randn, 2), "bf16-relu E2": (relu, 2),
        "random": (rand, 1), "zeros": (zeros, 1),
    }


def check(pages, payload, sizes, kinds, e):
    """Every page decodes to its input; tails are zero; kinds follow the rules."""
    n, size = pages.shape
    shuffled = pages
    bad = 0
    kinds_l, sizes_l = kinds.tolist(), sizes.tolist()
    pay = payload.numpy()
    src = pages.numpy()
    for i in range(n):
        k, s = kinds_l[i], sizes_l[i]
        if pay[i, s:].any():
            bad += 1
            continue
        if k == fmt.KIND_FILL:
            bad += not (s == 1 and (src[i] == src[i, 0]).all() and pay[i, 0] == src[i, 0])
        elif k == fmt.KIND_RAW:
            bad += not (s == size and (pay[i] == src[i]).all())
        else:
            if k != (fmt.KIND_LZ4 | (fmt.element_shift(e) << 4)) or s > fmt.lz4_keep_limit(size):
                bad += 1
                continue
            try:
                d = lz4.block.decompress(pay[i, :s].tobytes(), uncompressed_size=size)
            except Exception:  # noqa: BLE001
                bad += 1
                continue
            if e > 1:
                if i < 512:  # the torch reference shuffle is slow: a sample
                    shuffled = bitshuffle(pages[i : i + 1], e)[0].numpy()
                    bad += d != shuffled.tobytes()
            else:
                bad += d != src[i].tobytes()
    return bad


def nvcomp_compress(g, e):
    """nvCOMP batched LZ4 (4 KiB chunks, its bit-shuffle for e > 1): ("GB/s", "ratio") or "-"."""
    if g.device.type != "cuda":
        return "-", "-"
    try:
        from bench import nvcomp

        nv, why = nvcomp.load()
        if nv is None:
            print("  nvCOMP:", why)
            return "-", "-"
        plan = nvcomp.LZ4Plan(nv, g, e)
        ms = bench(plan.compress, 20, 200)
        plan.compress()
        torch.cuda.synchronize()
        flag = "" if plan.compress_ok() else " (status!)"
        return f"{NBYTES / ms / 1e6:.1f}", f"{NBYTES / plan.stored_bytes():.3f}{flag}"
    except Exception as exc:  # noqa: BLE001 - the baseline is optional
        print("  nvCOMP failed:", exc)
        return "-", "-"


def bench(fn, warmup, rep):
    if not torch.cuda.is_available():  # a dry run of the script under TRITON_INTERPRET=1
        fn()
        return 1.0
    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--only-sweep", action="store_true", help="skip the per-corpus table")
    ap.add_argument("--candidates", choices=lc.CANDIDATE_MODES, default=lc.DEFAULT_CANDIDATES)
    args = ap.parse_args()
    mode = dict(candidates=args.candidates)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "none (dry run)"
    print(f"GPU {name}, torch {torch.__version__}, "
          f"triton {triton.__version__}, {time.strftime('%Y-%m-%d %H:%M:%S')}", flush=True)
    t0 = time.time()
    data = corpora()
    print(f"corpora built in {time.time() - t0:.1f}s", flush=True)
    sample = torch.randperm(N, generator=torch.Generator().manual_seed(4))[:SAMPLE]
    rows = []
    print(f"table: candidates={args.candidates}, other tuning at the defaults", flush=True)
    for name, (pages, e) in data.items() if not args.only_sweep else ():
        g = pages.to(dev)
        t1 = time.time()
        payload, sizes, kinds = lc.compress_pages(g, e, traced=False, **mode)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        payload, sizes, kinds = payload.cpu(), sizes.cpu(), kinds.cpu()
        bad = check(pages, payload, sizes, kinds, e)
        ours_all = NBYTES / int(sizes.sum())
        ours_s = SAMPLE * P / int(sizes[sample].sum())
        ref = cpu_codec.compress_cpu(pages[sample], e)[1]
        ref_s = SAMPLE * P / int(ref.sum())
        ms = bench(lambda g=g, e=e: lc.compress_pages(g, e, traced=False, **mode), 50, 300)
        nv_gbs, nv_ratio = nvcomp_compress(g, e)
        row = (f"| {name:14s} | {NBYTES / ms / 1e6:7.1f} | {nv_gbs} | {ours_all:6.3f} | "
               f"{nv_ratio} | {ours_s:6.3f} | {ref_s:6.3f} | {ours_s / ref_s:6.3f} | {bad} |")
        rows.append(row)
        print(row, f"({time.time() - t1:.1f}s)", flush=True)
        del g
    print("\n| corpus | GB/s | nvCOMP GB/s | ratio | nvCOMP ratio | ratio (sample) | "
          "python-lz4 (sample) | ours/lz4 | bad |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    try:
        for _key, k in lc._lz4_compress_kernel.device_caches[dev.index or 0][0].items():
            print("compiled:", k.metadata.num_warps, "warps, regs", k.n_regs, "spills", k.n_spills)
    except Exception as exc:  # noqa: BLE001
        print("no resource info:", exc)
    if args.sweep or args.only_sweep:
        sweep(data, dev, sample)


def sweep(data, dev, sample):
    """GB/s, ratio and ratio vs python-lz4 (sample) per SWEEP point; every page is checked."""
    print("\nsweep: GB/s, ratio, ratio/python-lz4 on the sample",
          flush=True)
    for name in ("text", "mixed", "random", "bf16-relu E2"):
        pages, e = data[name]
        g = pages.to(dev)
        ref_s = SAMPLE * P / int(cpu_codec.compress_cpu(pages[sample], e)[1].sum())
        for cand, near, pps, w, xw, hb, nw in SWEEP:
            cfg = dict(candidates=cand, near=near, programs_per_sm=pps, window=w, extra_words=xw,
                       hash_bits=hb, num_warps=nw)
            t1 = time.time()
            ms = bench(lambda g=g, e=e, c=cfg: lc.compress_pages(g, e, traced=False, **c), 10, 100)
            out = [t.cpu() for t in lc.compress_pages(g, e, traced=False, **cfg)]
            bad = check(pages, *out, e)
            ratio = NBYTES / int(out[1].sum())
            ours_s = SAMPLE * P / int(out[1][sample].sum())
            print(f"  {name:12s} {cand:9s} near={near} pps={pps:2d} W={w:3d} XW={xw} hb={hb} "
                  f"nw={nw}: "
                  f"{NBYTES / ms / 1e6:7.1f} GB/s ratio {ratio:.3f} vs lz4 {ours_s / ref_s:.3f} "
                  f"bad {bad} ({time.time() - t1:.1f}s)", flush=True)
        del g


if __name__ == "__main__":
    np.random.seed(0)
    main()
