"""`make demo`: the main job on a realistic batch, on the GPU when usable, else on the CPU.

Builds 64 MiB (``--mib``) of mixed memory pages from files on this machine (text, shared
libraries, about 30% zero pages), compresses and decompresses them with ``torch_pagecomp`` and
prints the ratio, GB/s of uncompressed bytes and a bit-exact check (every page, plus lz4.block
decoding a sample of our LZ4 blocks); then the same for bf16 activations as bytes, with
``element_size=2`` (bit-shuffled) and with the exponent codec (``codec="exp-bf16"``, what
``PageCompressor`` and the offload hooks take for bf16), on the GPU or the CPU alike.
"""

from __future__ import annotations

import argparse
import time

import lz4.block
import torch

import torch_pagecomp as pc
from bench.corpora import build_corpus
from torch_pagecomp import cpu_codec
from torch_pagecomp import format as fmt
from torch_pagecomp.shuffle import bitshuffle


def _timed(fn, device: torch.device, calls: int = 2) -> tuple[object, float]:
    """``fn()``'s result and the best time of ``calls`` calls: the first call of a size also
    maps the memory of its outputs (on the CPU a page fault per 4 KiB, then reused)."""
    best = float("inf")
    for _ in range(calls):
        out = None  # the last call's outputs go back to the pools before the next
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return out, best


def _lz4_sample_ok(c: pc.CompressedPages, pages: torch.Tensor, count: int = 256) -> bool:
    """Decode up to ``count`` of our LZ4 blocks with the lz4 library; all must match."""
    kinds, sizes = c.kinds.cpu(), c.sizes.cpu()
    idx = torch.nonzero((kinds & 15) == fmt.KIND_LZ4).flatten()[:count]
    for i in idx.tolist():
        block = c.payload[i, : int(sizes[i])].cpu().numpy().tobytes()
        want = pages[i : i + 1].cpu()
        shift = int(kinds[i]) >> 4
        if shift:
            want = bitshuffle(want, 1 << shift)
        if lz4.block.decompress(block, uncompressed_size=c.page_size) != want.numpy().tobytes():
            return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="MiB of pages (default 64)")
    parser.add_argument("--page-size", type=int, default=4096)
    args = parser.parse_args()

    status = pc.gpu_status()
    device = torch.device("cuda" if status.usable else "cpu")
    print(f"torch {torch.__version__}, triton {status.triton_version}; GPU path: {status.reason}")
    print(f"device: {status.device_name if status.usable else 'CPU (lz4 reference path)'}")
    pages = build_corpus("mixed", args.mib << 20, page_size=args.page_size, device=device)
    n = pages.shape[0]
    print(f"batch: {n} pages of {args.page_size} bytes ({pages.numel() / 2**20:.0f} MiB), "
          "mixed memory: text, shared libraries, ~30% zero pages")

    pc.decompress(pc.compress(pages[:64]))  # warm-up: compiles the kernels on a GPU
    c, t_comp = _timed(lambda: pc.compress(pages), device)
    out, t_dec = _timed(lambda: pc.decompress(c), device)
    exact = bool(torch.equal(out, pages))
    packed = pc.pack(c)
    kinds = torch.bincount((c.kinds & 15).long().cpu(), minlength=3).tolist()
    gb = pages.numel() / 1e9
    print(f"kinds: {kinds[fmt.KIND_LZ4]} lz4, {kinds[fmt.KIND_RAW]} raw, "
          f"{kinds[fmt.KIND_FILL]} same-filled")
    print(f"ratio: {c.ratio():.3f}  ({pages.numel()} -> {packed.payload.numel()} bytes packed)")
    print(f"compress:   {gb / t_comp:8.2f} GB/s  ({t_comp * 1e3:.1f} ms, includes launch)")
    print(f"decompress: {gb / t_dec:8.2f} GB/s  ({t_dec * 1e3:.1f} ms; each the best of 2 calls)")
    print(f"bit-exact round trip of all {n} pages: {'yes' if exact else 'NO'}")
    sample_ok = _lz4_sample_ok(c, pages)
    print(f"lz4.block decodes our LZ4 blocks (sample of 256): {'yes' if sample_ok else 'NO'}")
    typed_ok = _typed(args.mib, args.page_size, device)
    if not (exact and sample_ok and typed_ok):
        raise SystemExit(1)


def _typed(mib: int, page_size: int, device: torch.device) -> bool:
    """bf16 activations (ReLU outputs): bytes against ``element_size=2`` (bit-shuffled) and the
    exponent codec; every round trip checked, and ``lz4.block`` reads a sample of the LZ4
    ones."""
    x = torch.relu(torch.randn((mib << 20) // 2, device=device)).to(torch.bfloat16)
    pages = x.view(torch.uint8).view(-1, page_size)
    where = "GPU" if device.type == "cuda" else f"CPU, {cpu_codec.cpu_threads()} thread(s)"
    print(f"typed batch: {pages.numel() / 2**20:.0f} MiB of bf16 ReLU activations ({where})")
    ok = True
    ways = (("bytes", {}), ("element_size=2", {"element_size": 2}),
            ('codec="exp-bf16"', {"codec": "exp-bf16"}))
    for label, kw in ways:
        pc.decompress(pc.compress(pages[:64], **kw))  # warm-up
        c, t_comp = _timed(lambda kw=kw: pc.compress(pages, **kw), device)
        out, t_dec = _timed(lambda c=c: pc.decompress(c), device)
        ok &= bool(torch.equal(out, pages))
        if "codec" not in kw:  # LZ4 blocks: lz4.block reads them
            ok &= _lz4_sample_ok(c, pages, 64)
        gb = pages.numel() / 1e9
        print(f"  {label:16s} ratio {c.ratio():.3f}  compress {gb / t_comp:6.2f} GB/s  "
              f"decompress {gb / t_dec:6.2f} GB/s")
    print(f"  bit-exact round trips and lz4.block samples: {'yes' if ok else 'NO'}")
    return ok


if __name__ == "__main__":
    main()
