"""Speed of the CPU path as ratios against lz4.block in the same process (no absolute times):
the numpy bit-shuffle, typed against byte compression, threads, and the exponent codec's C
loops against its numpy reference."""

import os
import time

import lz4.block
import pytest
import torch
from pages import file_pages

from torch_pagecomp import cpu_codec, exp_codec
from torch_pagecomp.shuffle import bitshuffle_np, bitunshuffle_np


def best(fn, reps: int = 3) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def bests(*fns, reps: int = 5) -> list[float]:
    """The best time of each of ``fns``, run in turns: a burst of load from another process
    (xdist's other worker) then slows every one of them, not only the one timed during it."""
    times = [[] for _ in fns]
    for _ in range(reps):
        for t, fn in zip(times, fns):
            start = time.perf_counter()
            fn()
            t.append(time.perf_counter() - start)
    return [min(t) for t in times]


def bf16_pages(mib: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.relu(torch.randn((mib << 20) // 2, generator=gen)).to(torch.bfloat16)
    return x.view(torch.uint8).view(-1, 4096)


@pytest.fixture
def one_thread():
    cpu_codec.set_cpu_threads(1)
    yield
    cpu_codec.set_cpu_threads(None)


@pytest.mark.parametrize("element_size, ratio", [(2, 1.0), (4, 1.25)])
def test_shuffle_round_trip_faster_than_lz4_compress(element_size, ratio, gen):
    """Shuffle + unshuffle of 16 MiB take less time than lz4.block compressing it page by page
    (numpy: measured 0.63-0.8 of it for 2-byte, 0.7-0.8 for 4-byte elements on a loaded 2-core
    VM, about 2 and 1.3 GB/s alone when the core is free; the C extension's SSE2 loops, where
    built: 3.9 / 5.5 GB/s for 2-byte elements on that VM)."""
    pages = bf16_pages(16, gen).numpy()
    y = bitshuffle_np(pages, element_size)
    t_lz4, t_shuffle, t_unshuffle = bests(
        lambda: [lz4.block.compress(row, store_size=False) for row in pages],
        lambda: bitshuffle_np(pages, element_size),
        lambda: bitunshuffle_np(y, element_size))
    assert t_shuffle + t_unshuffle < ratio * t_lz4, (t_shuffle, t_unshuffle, t_lz4)


def test_typed_compress_within_twice_byte_compress(gen, one_thread):
    """compress_cpu with element_size=2 on bf16 pages: within 2x the time of element_size=1
    (measured 0.6-0.9x: the shuffle is cheap and shuffled pages compress faster)."""
    pages = bf16_pages(8, gen)
    t_bytes, t_typed = bests(lambda: cpu_codec.compress_cpu(pages, 1),
                             lambda: cpu_codec.compress_cpu(pages, 2), reps=3)
    assert t_typed < 2 * t_bytes, (t_typed, t_bytes)


def free_core_speedup() -> float:
    """How much faster two threads of GIL-free numpy work run than one, here and now (about 2
    on an idle 2-core machine, about 1 while another process holds a core)."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    a = np.random.default_rng().random(1 << 20)
    with ThreadPoolExecutor(2) as pool:
        t1 = best(lambda: [np.sort(a) for _ in range(4)])
        t2 = best(lambda: list(pool.map(lambda _: [np.sort(a) for _ in range(2)], range(2))))
    return t1 / t2


@pytest.mark.slow
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 cores")
@pytest.mark.parametrize("op", ["compress", "decompress"])
def test_two_threads_scale(gen, op):
    """Compression or decoding of compressible pages on 2 threads against 1: at least 0.8x the
    speed-up that two threads of plain numpy get at the same moment (up to 3 tries; skipped
    when numpy gets below 1.5x: no second core free); the result is the same bytes. With the C
    loops (``_native``); page by page through python-lz4 the threads convoy on the GIL (2
    threads: 0.96-1.27x compress, 0.7-0.8x decode), so there it is expected to fail."""
    if cpu_codec._native is None:
        pytest.xfail("torch_pagecomp._native is not built: python-lz4 page by page")
    pages = file_pages("text", 4096, 4096, gen)
    payload, sizes, kinds = cpu_codec.compress_cpu(pages)
    offsets = torch.arange(pages.shape[0], dtype=torch.int64) * 4096
    if op == "compress":
        def run():
            return cpu_codec.compress_cpu(pages)
    else:
        def run():
            return cpu_codec.decompress_cpu(payload.view(-1), offsets, sizes, kinds, 4096)
    tries = []
    try:
        for _ in range(3):
            cpu_codec.set_cpu_threads(1)
            one = run()
            t1 = best(run)
            cpu_codec.set_cpu_threads(2)
            two = run()
            t2 = best(run)
            assert all(torch.equal(a, b) for a, b in zip(one, two))
            free = free_core_speedup()
            tries.append((t1 / t2, free))
            if free >= 1.5 and t1 / t2 >= 0.8 * free:
                return
    finally:
        cpu_codec.set_cpu_threads(None)
    if all(free < 1.5 for _, free in tries):
        pytest.skip(f"no second core free now (numpy on 2 threads: {tries})")
    raise AssertionError(f"(speed-up, numpy's) per try: {tries}")


def decode_ratio(pages: torch.Tensor) -> float:
    """Time of ``decompress_cpu`` (one thread) over the time of ``lz4.block.decompress`` on the
    same LZ4 blocks, page by page (best of 5 each, run in turns: timed one after the other,
    a burst of load from xdist's other worker during one side's runs read as 3.7x in a
    clean-clone CI run, session 70)."""
    payload, sizes, kinds = cpu_codec.compress_cpu(pages)
    n, p = pages.shape
    offsets = torch.arange(n, dtype=torch.int64) * p
    rows = payload.numpy()
    blocks = [rows[i, : int(sizes[i])].tobytes() for i in range(n) if int(kinds[i]) & 15 == 1]
    assert len(blocks) > n // 2
    t_lz4, t_ours = bests(
        lambda: [lz4.block.decompress(b, uncompressed_size=p) for b in blocks],
        lambda: cpu_codec.decompress_cpu(payload.view(-1), offsets, sizes, kinds, p))
    out, status = cpu_codec.decompress_cpu(payload.view(-1), offsets, sizes, kinds, p)
    assert not status.any() and torch.equal(out, pages)
    return t_ours / t_lz4


def test_decode_without_zero_runs_near_lz4(gen, one_thread):
    """Text pages: decompress_cpu within 2.5x of lz4.block with the C decoder (measured
    1.0-1.1x on the 2-core VM), within 3x page by page through python-lz4 (1.5-2.5x on a loaded
    VM: the per-page Python steps)."""
    bound = 2.5 if cpu_codec._native is not None else 3
    assert decode_ratio(file_pages("text", 1024, 4096, gen)) < bound


def test_decode_with_zero_runs_near_lz4(gen, one_thread):
    """bf16 ReLU activations as bytes (every page holds zero runs): within 4x of lz4.block with
    the C decoder, which enforces the offset-0 rule as it decodes (measured 0.9-1.7x); within
    12x through python-lz4, where every such block's sequences are walked again for a match
    offset of 0 (``zero_offsets``; measured 4-9x; a numpy step costs the same for one block as
    for a thousand, so small batches pay more per page)."""
    bound = 4 if cpu_codec._native is not None else 12
    assert decode_ratio(bf16_pages(8, gen)) < bound


@pytest.mark.skipif(not exp_codec.NATIVE, reason="torch_pagecomp._native is not built")
def test_exp_codec_native_faster_than_numpy(gen, one_thread):
    """The exponent codec's C encode and decode (one thread) against its numpy reference on
    4 MiB of bf16 pages (ReLU of normal: FILL-free, EXP pages with escapes): encode at least
    10x, decode at least 5x (measured on the 2-core VM, 64 MiB of normal bf16: encode 1.0
    against 0.027-0.030 GB/s, decode 0.9-1.0 against 0.05-0.06 GB/s: 33-37x and 15-17x; on
    these ReLU pages encode 24-25x, decode 12-14x, and 9.6x once in a clean-clone CI run
    beside other work: the numpy reference decodes these pages faster)."""
    from torch_pagecomp import format as fmt

    pages = bf16_pages(4, gen)
    payload, sizes, kinds = exp_codec.compress_exp_cpu(pages, fmt.EXP_BF16)
    offsets = torch.arange(pages.shape[0], dtype=torch.int64) * pages.shape[1]
    args = (payload.view(-1), offsets, sizes, kinds, pages.shape[1])
    t_c, t_np = bests(lambda: exp_codec.compress_exp_cpu(pages, fmt.EXP_BF16),
                      lambda: exp_codec.compress_exp_cpu(pages, fmt.EXP_BF16, native=False),
                      reps=3)
    assert 10 * t_c < t_np, (t_c, t_np)
    t_c, t_np = bests(lambda: exp_codec.decompress_exp_cpu(*args),
                      lambda: exp_codec.decompress_exp_cpu(*args, native=False), reps=3)
    assert 5 * t_c < t_np, (t_c, t_np)
