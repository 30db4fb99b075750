"""Dev probe for the Triton LZ4 page decoder on a GPU (one script per GPU session).

``python3 -m bench.dev_decompress_probe --bench`` builds 128 MiB of pages per corpus, compresses
them on the CPU (``cpu_codec.compress_cpu``, packed), checks a bit-exact decode of every page on
the GPU (``WRONG`` in the table otherwise), also decodes nvCOMP's own RAW LZ4 blocks of the same
pages, and times (``triton.testing.do_bench``, median) the decoder beside nvCOMP's batched LZ4
decompression and a device copy. ``--sanitize`` decodes a small hostile batch (for
``compute-sanitizer --tool memcheck``). (The variants of the decoder's former knobs were
removed with the knobs; see git history.) ``--run-bytes 64,128,256`` also times the plain
kernel alone with each copy step (``DecodeConfig.RUN_BYTES``: literal runs and matches longer
than ``VEC_BYTES``; the package's is 64) on the untyped corpora, each checked bit-exact: does
a wider step pay on byte pages (#26's 1.4x over nvCOMP)?
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import sys
import time
from functools import partial

import torch
import triton

from bench import nvcomp
from bench.corpora import build_corpus, element_size
from torch_pagecomp import format as fmt
from torch_pagecomp.cpu_codec import compress_cpu, pack_cpu
from torch_pagecomp.kernels import lz4_decompress as D

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run under TRITON_INTERPRET=1

def kernel_resources(args, out, status, page_size: int) -> str:
    """Registers and spills of the two decoder kernels (compiles them)."""
    n = status.shape[0]
    ks = [D._decompress_kernel[(n,)](*args, out, status, args[0].numel(),
                                     **D.decode_config(page_size).meta()),
          D._decompress_shuffled_kernel[(n,)](*args, out, status, args[0].numel(),
                                              **D.shuffled_decode_config(page_size).meta())]
    return ", ".join(f"{k.n_regs} regs {k.n_spills} spills" for k in ks)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def packed_on_gpu(pages: torch.Tensor, element_size: int):
    payload, sizes, kinds = compress_cpu(pages, element_size)
    flat, offsets = pack_cpu(payload, sizes)
    t = int(offsets[-1])
    return tuple(x.to(DEV) for x in (flat[:t], offsets[:-1], sizes, kinds)), t


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def bench_ms(fn) -> float:
    if DEV != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return triton.testing.do_bench(fn, warmup=10, rep=200, return_mode="median")


def plain_step_rows(args, out, status, gpu_pages, page_size: int, run_bytes: list[int]) -> dict:
    """The plain kernel alone (every page of an untyped corpus is plain) with each copy step
    of ``run_bytes``: ``{"plain RUN=r": (GB/s, bit-exact)}``."""
    n, rows = status.shape[0], {}
    for rb in run_bytes:
        meta = dataclasses.replace(D.decode_config(page_size), RUN_BYTES=rb).meta()

        def launch(meta=meta):
            D._decompress_kernel[(n,)](*args, out, status, args[0].numel(), **meta)

        out.fill_(0xA5)
        status.fill_(-1)
        launch()
        sync()
        ok = bool((status == 0).all()) and torch.equal(out, gpu_pages)
        rows[f"plain RUN={rb}"] = (n * page_size / bench_ms(launch) / 1e6, ok)
    return rows


def run_bench(corpora: list[str], page_size: int, mib: float,
              run_bytes: list[int] | None = None) -> None:
    nv, why = nvcomp.load() if DEV == "cuda" else (None, "no CUDA")
    if nv is None:
        log(f"nvCOMP unavailable: {why}")
    rows = []
    for name in corpora:
        es = element_size(name)
        pages = build_corpus(name, int(mib * 2**20), page_size, "cpu", seed=None)
        n = pages.shape[0]
        t0 = time.time()
        args, stored = packed_on_gpu(pages, es)
        log(f"{name}: {n} pages, lz4 on CPU in {time.time() - t0:.1f}s, "
            f"ratio {n * page_size / stored:.3f}")
        gpu_pages = pages.to(DEV)
        out = torch.empty_like(gpu_pages)
        status = torch.empty(n, dtype=torch.int32, device=DEV)
        row = {"corpus": name, "P": page_size, "ratio": n * page_size / stored}
        out.fill_(0xA5)
        status.fill_(-1)
        D.decompress_into(*args, out, status)
        sync()
        ok = bool((status == 0).all()) and torch.equal(out, gpu_pages)
        ms = bench_ms(partial(D.decompress_into, *args, out, status, traced=False))
        row["ours"] = (n * page_size / ms / 1e6, ok)
        if run_bytes and es == 1:
            row.update(plain_step_rows(args, out, status, gpu_pages, page_size, run_bytes))
        if DEV == "cuda" and name == corpora[0]:
            log(f"kernels: {kernel_resources(args, out, status, page_size)}")
        if nv is not None:
            plan = nvcomp.LZ4Plan(nv, gpu_pages, es)
            plan.compress()
            torch.cuda.synchronize()
            row["nv_ratio"] = n * page_size / plan.stored_bytes()
            plan.decompress()
            torch.cuda.synchronize()
            ms = bench_ms(plan.decompress)
            row["nvcomp"] = (n * page_size / ms / 1e6, plan.roundtrip_ok())
            if es == 1:  # our decoder on nvCOMP's blocks
                nargs = (plan.out.view(-1),
                         torch.arange(n, device="cuda", dtype=torch.int64) * plan.stride,
                         plan.sizes.to(torch.int32),
                         torch.full((n,), fmt.KIND_LZ4, dtype=torch.uint8, device="cuda"))
                out.fill_(0xA5)
                D.decompress_into(*nargs, out, status)
                torch.cuda.synchronize()
                ok = bool((status == 0).all()) and torch.equal(out, gpu_pages)
                # blocks over P - P/32 (nvCOMP's, like lz4's, for pages it cannot compress):
                # read since the decoders take any block up to LZ4_compressBound(P)
                row["nv_blocks_over_limit"] = int((nargs[2] > fmt.lz4_keep_limit(page_size)).sum())
                ms = bench_ms(partial(D.decompress_into, *nargs, out, status, traced=False))
                row["ours_on_nv_blocks"] = (n * page_size / ms / 1e6, ok)
            del plan
        ms = bench_ms(partial(out.copy_, gpu_pages))
        row["d2d_copy"] = (n * page_size / ms / 1e6, True)
        log(str(row))
        rows.append(row)
        del gpu_pages, out, args
        torch.cuda.empty_cache()
    cols = (["ours"] + [f"plain RUN={rb}" for rb in run_bytes or ()]
            + ["ours_on_nv_blocks", "nvcomp", "d2d_copy"])
    print("\n| corpus | P | ratio (lz4 CPU) | ratio nvCOMP | " + " | ".join(cols) + " |")
    print("|---" * (4 + len(cols)) + "|")
    for r in rows:
        cells = []
        for c in cols:
            if c in r:
                g, ok = r[c]
                cells.append(f"{g:.1f}" + ("" if ok else " WRONG"))
            else:
                cells.append("-")
        print(f"| {r['corpus']} | {r['P']} | {r['ratio']:.3f} | {r.get('nv_ratio', 0):.3f} | "
              + " | ".join(cells) + " |")
    print("GB/s = uncompressed bytes / median time (triton.testing.do_bench)")


def run_sanitize() -> None:
    """A small hostile batch (valid, mutated, garbage metadata, shuffled, 64 KiB pages)."""
    from test_triton_decompress import fuzz_bases, mutate, random_block

    rng = random.Random()
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    for page_size in (4096, 65536):
        bases = fuzz_bases(rng, gen, 12) if page_size == 4096 else [
            random_block(page_size, rng.choice([4, 40, 400]), rng) for _ in range(8)]
        blocks, payload, offsets = [], bytearray(), []
        for i in range(400 if page_size == 4096 else 48):
            blk, tail = (rng.choice(bases), b"") if i % 4 == 0 else mutate(
                rng.choice(bases), bases, rng)
            offsets.append(len(payload))
            blocks.append(blk)
            payload += blk + tail
        n = len(blocks)
        kinds = torch.full((n,), fmt.KIND_LZ4, dtype=torch.uint8)
        kinds[1::7] = fmt.KIND_LZ4 | 1 << 4
        kinds[2::7] = fmt.KIND_LZ4 | 2 << 4
        kinds[3::11] = torch.randint(0, 256, kinds[3::11].shape, dtype=torch.uint8)
        sizes = torch.tensor([len(b) for b in blocks], dtype=torch.int32)
        offs = torch.tensor(offsets, dtype=torch.int64)
        sizes[5::13] = torch.randint(-(1 << 31), (1 << 31) - 1, sizes[5::13].shape,
                                     dtype=torch.int32)
        offs[6::13] += torch.randint(-(1 << 20), 1 << 20, offs[6::13].shape)
        flat = torch.frombuffer(payload, dtype=torch.uint8)
        pages, status = D.decompress_pages(flat.to(DEV), offs.to(DEV), sizes.to(DEV),
                                           kinds.to(DEV), page_size)
        sync()
        check_hostile(page_size, payload, offs, sizes, kinds, pages.cpu(), status.cpu())


def check_hostile(page_size, payload, offs, sizes, kinds, pages, status) -> None:
    """Statuses and bytes of every page against ``ref_page`` (``decode_block`` rules)."""
    from test_triton_decompress import ref_page

    def read(o, s):
        return bytes(payload[o : o + s])

    bad = 0
    for i in range(status.shape[0]):
        data, st = ref_page(read, len(payload), int(offs[i]), int(sizes[i]), int(kinds[i]),
                            page_size)
        bad += int(status[i]) != st
        bad += data is not None and bytes(pages[i].numpy()) != data
    zero_ok = not pages[status != 0].any()
    counts = torch.bincount(status, minlength=7).tolist()
    log(f"sanitize P={page_size}: {status.shape[0]} pages, statuses {counts}, mismatches "
        f"against decode_block {bad}, failed rows zero {zero_ok}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--sanitize", action="store_true")
    ap.add_argument("--corpora", default="text,binary,mixed,bf16-relu")
    ap.add_argument("--big-pages", action="store_true", help="also mixed at 64 KiB pages")
    ap.add_argument("--mib", type=float, default=128, help="MiB of pages per corpus")
    ap.add_argument("--run-bytes", default="",
                    help="comma-separated copy steps for the plain kernel alone (e.g. 64,128,256)")
    a = ap.parse_args()
    run_bytes = [int(x) for x in a.run_bytes.split(",") if x]
    name = torch.cuda.get_device_name() if DEV == "cuda" else "cpu (interpreter)"
    log(f"{name} torch {torch.__version__} triton {triton.__version__}")
    if a.sanitize:
        run_sanitize()
    if a.bench:
        run_bench(a.corpora.split(","), 4096, a.mib, run_bytes)
        if a.big_pages:
            run_bench(["mixed"], 65536, a.mib)


if __name__ == "__main__":
    main()
