"""``PageCompressor``'s kernel-only path (``torch_pagecomp._direct``): GPU tensors of one batch
or less go to the store the hooks and the KV cache use instead of the threaded ring (#26).

On the CPU the path runs with the Triton interpreter (the store's pack kernel), the routing
forced on for a CPU compressor; the GPU tests at the end check the routing itself, the bound
on bytes in flight and the latency path on a real card. Outputs are poisoned before every
restore.
"""

from __future__ import annotations

import gc

import pytest
import torch
from pages import file_pages, offload_cycles

from torch_pagecomp import KIND_RAW
from torch_pagecomp.api import decompress
from torch_pagecomp.format import CorruptPageError
from torch_pagecomp.module import PageCompressor

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def poisoned_restore(pc, h, like):
    out = torch.full_like(like, 0x5A) if like.dtype == torch.uint8 else torch.full_like(like, 7)
    return pc.restore(h, out=out, check=True)


@pytest.mark.parametrize("nbytes", [1, 4095, 4096, 3 * 4096 + 17, 4 * 4096])
def test_round_trip_odd_sizes_and_state(direct, gen, nbytes):
    """Full pages and a partial last page (a plain copy) come back exact; the handle reports
    the path's sizes, codec and state; the packed container decodes to the same bytes."""
    pc = direct()
    x = file_pages("text", 4, 4096, gen).reshape(-1)[:nbytes].clone()
    h = pc.offload(x)
    assert h._storage.direct and h.state == "ready" and h.ready()
    assert torch.equal(poisoned_restore(pc, h, x), x)
    assert torch.equal(pc.restore(h, device="cpu"), x)
    full = nbytes // 4096
    assert h.stored_nbytes >= nbytes % 4096 + 13 * full
    if full:
        kin, kout = h.kernel_bytes()
        assert kin == full * 4096 and 0 < kout < kin  # text compresses
    c = h.compressed()
    assert c.num_pages == -(-nbytes // 4096)
    assert torch.equal(decompress(c).reshape(-1)[:nbytes], x)
    if nbytes % 4096:
        assert int(c.kinds[-1]) == KIND_RAW
    s = pc.stats()
    assert s["direct"]["offloads"] == 1 and s["offloads"] == 1 and s["batches"] == 0


def test_exp_codec_and_dtypes(direct, gen):
    """bf16 through the exponent codec (codec="exp"), fp32 through LZ4 bit-shuffled by 4."""
    pc = direct(codec="exp")
    a = torch.randn(2 * 2048 + 3, generator=gen).to(torch.bfloat16)
    b = torch.randn(3, 341, generator=gen)
    ha, hb = pc.offload(a), pc.offload(b)
    assert ha.codec == "exp" and hb.codec == "lz4"
    assert torch.equal(poisoned_restore(pc, ha, a).view(torch.int16), a.view(torch.int16))
    assert torch.equal(poisoned_restore(pc, hb, b).view(torch.int32), b.view(torch.int32))
    assert torch.equal(decompress(ha.compressed()).reshape(-1)[:a.numel() * 2],
                       a.view(torch.uint8))


def test_larger_tensors_take_the_ring(direct, gen):
    """A tensor of more than one batch goes through the ring, as before."""
    pc = direct()
    x = file_pages("text", 9, 4096, gen).reshape(-1)
    h = pc.offload(x)
    assert not h._storage.direct
    assert torch.equal(poisoned_restore(pc, h, x), x)
    assert "direct" not in pc.stats() and pc.stats()["batches"] == 3


def test_free_returns_the_host_bytes(direct, gen):
    pc = direct()
    x = file_pages("text", 3, 4096, gen).reshape(-1)
    h = pc.offload(x)
    assert pc.stats()["bytes_held_host"] > 0
    h.free()
    assert h.state == "freed" and pc.stats()["bytes_held_host"] == 0
    h2 = pc.offload(x)
    del h2
    gc.collect()
    assert pc.stats()["bytes_held_host"] == 0
    assert pc.empty_cache() >= 0 and pc.stats()["pinned_bytes_held"] == 0


@pytest.mark.parametrize("pages", [2, 9])  # the kernel-only store, the ring
def test_a_freed_handle_refuses_restore_and_compressed(direct, gen, pages):
    from torch_pagecomp import PageCompError

    pc = direct()
    h = pc.offload(file_pages("text", pages, 4096, gen).reshape(-1))
    h.free()
    for call in (pc.restore, lambda h: h.compressed()):
        with pytest.raises(PageCompError, match="freed"):
            call(h)


def test_threads_offload_and_restore_at_once(direct, gen):
    """Two threads offload and restore through one compressor at once: every tensor exact."""
    import threading

    pc = direct(codec="exp")
    xs = [file_pages("text", 1 + k % 4, 4096, gen).reshape(-1)[: 4096 * (1 + k % 4) - k]
          for k in range(8)]
    xs += [_floats(gen, 2048 * (1 + k % 3) + k, torch.bfloat16) for k in range(6)]  # small store
    errors = []

    def work(part):
        try:
            for x in part:
                h = pc.offload(x)
                assert torch.equal(pc.restore(h).view(torch.uint8), x.view(torch.uint8))
                h.free()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(xs[k::2],)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert pc.stats()["direct"]["offloads"] == 14 and pc.stats()["bytes_held_host"] == 0


def test_free_while_the_store_is_busy_waits_in_the_sink(direct, gen):
    """A handle freed while the path's lock is held (a finalizer running inside the store's
    bookkeeping) is not freed there: it waits in the sink for the next call."""
    pc = direct()
    x = file_pages("text", 2, 4096, gen).reshape(-1)
    h = pc.offload(x)
    h.wait()  # placed: its bytes count as used
    path = pc._direct
    with path._lock:
        h.free()
        assert len(path._sink) == 1 and pc._direct.store.arena.used > 0
    assert pc.stats()["bytes_held_host"] == 0 and not path._sink


def test_ratio_counts_both_paths(direct, gen):
    pc = direct()
    zeros = torch.zeros(4 * 4096, dtype=torch.uint8)  # FILL pages: ~1 byte each
    noise = torch.randint(0, 256, (4 * 4096,), dtype=torch.uint8, generator=gen)
    pc.offload(zeros), pc.offload(noise)
    ratio = pc.stats()["ratio"]
    assert 1.9 < ratio < 2.1  # 8 pages in, ~4 pages stored


def _stored_pages(pc, h):
    """The host bytes of ``h``'s pages, as views into the arena (to corrupt them)."""
    h.wait()  # placed: the host knows where
    store = pc._direct.store
    (sl,) = h._storage.stored.slices
    return [v for _, v in store.arena.pieces(sl.base, sl.total)], sl


@pytest.mark.parametrize("checksum", [False, True])
def test_corrupt_page_is_named(direct, gen, checksum):
    """A page whose host bytes are damaged fails restore(check=True) with its index; with
    checksums a RAW page decoded 'fine' to the wrong bytes is caught too; nothing is written
    outside the output."""
    pc = direct(checksum=checksum)
    x = torch.cat([file_pages("text", 2, 4096, gen).reshape(-1),
                   torch.randint(0, 256, (2 * 4096,), dtype=torch.uint8, generator=gen)])
    h = pc.offload(x)
    views, sl = _stored_pages(pc, h)
    blob = views[0]
    rel, sizes = sl.rel.tolist(), sl.sizes.tolist()
    raw_page = 3  # random bytes: stored RAW, at rel[3]
    assert sizes[raw_page] == 4096
    blob[rel[raw_page] + 100] ^= 0xFF
    if checksum:
        with pytest.raises(CorruptPageError, match="checksum mismatch") as exc:
            poisoned_restore(pc, h, x)
        assert exc.value.pages == [3]
    else:
        got = pc.restore(h, check=True)  # RAW pages carry no check of their own
        assert not torch.equal(got, x) and torch.equal(got[:3 * 4096], x[:3 * 4096])
    blob[rel[0]] = 0xFF  # the first token of an LZ4 page: a literal run past the block
    blob[rel[0] + 1: rel[0] + sizes[0]] = 0xFF
    with pytest.raises(CorruptPageError) as exc:
        poisoned_restore(pc, h, x)
    assert exc.value.pages == ([0, 3] if checksum else [0])


def test_offload_after_close_is_refused_and_handles_stay_readable(direct, gen):
    from torch_pagecomp.pipeline import PipelineStopped

    pc = direct()
    x = file_pages("text", 2, 4096, gen).reshape(-1)
    h = pc.offload(x)
    pc.close()
    assert torch.equal(pc.restore(h, device="cpu"), x)
    with pytest.raises(PipelineStopped):
        pc.offload(x)


@pytest.mark.parametrize("what", ["store", "ring", "small"])
@pytest.mark.parametrize("drop", ["free", "del"])
def test_a_handle_freed_after_close_gives_back_its_host_memory(direct, gen, what, drop):
    """After ``close`` nothing reuses the pools: the last handle's pages go back to the OS
    as it is freed (the kernel-only store's were held until interpreter exit)."""
    pc = direct()
    if what == "small":
        x = _floats(gen, 3000, torch.bfloat16)
    else:
        x = file_pages("text", 2 if what == "store" else 9, 4096, gen).reshape(-1)
    h = pc.offload(x)
    assert h._storage.direct == (what != "ring")
    pc.close()
    assert pc.stats()["host_pool_bytes"] > 0  # (page-locked on a GPU host)
    assert torch.equal(pc.restore(h, device="cpu"), x)
    assert h.stored_nbytes > 0
    if drop == "free":
        h.free()
        assert h.stored_nbytes == 0 and h.state == "freed"
    else:
        del h
        gc.collect()
    assert pc.stats()["host_pool_bytes"] == 0


@pytest.mark.parametrize("fails", ["small", "store"])
def test_a_drain_that_raises_frees_the_rest_later(direct, gen, monkeypatch, fails):
    """Handles freed while the path is busy wait in its sink; a free there that raises (an
    interrupt) leaves the others in the sink for the next call, not lost for good."""
    pc = direct()
    small = [pc.offload(_floats(gen, 3000, torch.bfloat16)) for _ in range(2)]
    paged = [pc.offload(file_pages("text", 2, 4096, gen).reshape(-1)) for _ in range(2)]
    path = pc._direct
    with path._lock:  # busy: the frees wait in the sink
        for h in small + paged:
            h.free()
    assert len(path._sink) == 4
    owner, name = (path.small, "free") if fails == "small" else (path.store, "free")
    real = getattr(owner, name)
    calls = []

    def free_once_raising(stored):
        calls.append(stored)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real(stored)

    monkeypatch.setattr(owner, name, free_once_raising)
    with pytest.raises(KeyboardInterrupt):
        path.release_idle()
    monkeypatch.setattr(owner, name, real)
    path.release_idle()
    assert not path._sink
    st = pc.stats()
    assert st["bytes_held_host"] == 0 and st["host_pool_bytes"] == 0


# ------------------------------------------------------------------ the small store (#26)
def _floats(gen, n: int, dtype: torch.dtype) -> torch.Tensor:
    """``n`` values of ``dtype`` as activations look: small normals, a fifth of them zero."""
    x = torch.randn(n, generator=gen) * 0.02
    x[torch.rand(n, generator=gen) < 0.2] = 0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [1, 100, 2048, 3 * 2048 + 7, 4 * 2048])
def test_small_store_takes_16_bit_floats_exactly(direct, gen, dtype, n):
    """bf16 / fp16 tensors up to SMALL_BYTES go to the small store (one encode, one copy,
    one decode): exact into a poisoned output and to the CPU, its packed container decodes to
    the same bytes, the block is trimmed to what the pages hold, and freed on free."""
    from torch_pagecomp._direct import SmallStorage

    pc = direct(codec="exp")
    x = _floats(gen, n, dtype)
    h = pc.offload(x)
    assert isinstance(h._storage, SmallStorage) and h.codec == "exp" and h.ready()
    assert torch.equal(poisoned_restore(pc, h, x).view(torch.int16), x.view(torch.int16))
    assert torch.equal(pc.restore(h, device="cpu").view(torch.int16), x.view(torch.int16))
    got = decompress(h.compressed()).reshape(-1)[:2 * n]
    assert torch.equal(got, x.view(torch.uint8))
    stored = h._storage.stored
    d = pc.stats()["direct"]
    assert d["small_host_used_bytes"] == -(-stored.host_nbytes() // 256) * 256
    full = 2 * n // 4096
    if full:  # the pages compress (their exponents are few): the block holds less
        kin, kout = h.kernel_bytes()
        assert kin == full * 4096 and kout < kin
        assert h.stored_nbytes < 2 * n
    h.free()
    d = pc.stats()["direct"]
    assert d["small_host_used_bytes"] == 0 and d["host_used_bytes"] == 0


def test_small_store_names_corrupt_pages(direct, gen):
    """A block whose metadata or pages are damaged fails restore(check=True) with the pages'
    indexes; the other pages come back, nothing is written outside the output."""
    pc = direct(codec="exp")
    x = _floats(gen, 4 * 2048, torch.bfloat16)
    h = pc.offload(x)
    rel, sizes, kinds, pages = h._storage.stored.views()
    sizes[1] = 4096 + 16  # more than a page
    kinds[2] = 0x7F  # no such kind
    out = torch.full((4 * 2048 + 64,), 7.0, dtype=torch.bfloat16)
    with pytest.raises(CorruptPageError) as exc:
        pc.restore(h, out=out[:4 * 2048], check=True)
    assert exc.value.pages == [1, 2]
    keep = [0, 3]
    got = out[:4 * 2048].view(4, 2048)
    assert torch.equal(got[keep].view(torch.int16), x.view(4, 2048)[keep].view(torch.int16))
    assert torch.equal(out[4 * 2048:], torch.full((64,), 7.0, dtype=torch.bfloat16))


def test_small_store_leaves_larger_tensors_lz4_and_checksums_to_the_store(direct, gen,
                                                                          monkeypatch):
    """Past SMALL_BYTES, for LZ4's dtypes and with checksums, tensors take the arena store."""
    from torch_pagecomp import _direct

    monkeypatch.setattr(_direct, "SMALL_BYTES", 2 * 4096)
    pc = direct(codec="exp")
    big = _floats(gen, 3 * 2048, torch.bfloat16)
    small = _floats(gen, 2 * 2048, torch.bfloat16)
    ints = torch.randint(0, 9, (1024,), dtype=torch.int32, generator=gen)
    hs = [pc.offload(t) for t in (big, small, ints)]
    assert [type(h._storage).__name__ for h in hs] == ["DirectStorage", "SmallStorage",
                                                       "DirectStorage"]
    for t, h in zip((big, small, ints), hs):
        assert torch.equal(poisoned_restore(pc, h, t).view(torch.uint8), t.view(torch.uint8))
    checked = direct(codec="exp", checksum=True)
    h = checked.offload(small)
    assert type(h._storage).__name__ == "DirectStorage"
    assert torch.equal(poisoned_restore(checked, h, small).view(torch.int16),
                       small.view(torch.int16))


def test_small_store_launch_keys_decide_the_argument_classes():
    """The small store keeps each launch's compiled entry by a key standing for its arguments'
    classes (``launch.launch_cached``): over page counts, tails, parities and alignments, each
    key meets one set of classes, the ones ``launch.known_args`` gives the tensors a first
    launch takes."""
    pytest.importorskip("triton")
    from torch_pagecomp.kernels.launch import known_args
    from torch_pagecomp.offload import _small_store as ss
    from torch_pagecomp.pools import HostArena

    p = 4096
    table = ss.launch_table(p)
    seen: dict = {}

    def check(key, values, args):
        classes = table[key[0]][2](*values)
        assert classes == known_args(args)[0], key
        assert seen.setdefault(key, classes) == classes, key

    arena = HostArena(pin=False, chunk_bytes=1 << 20)
    raw = torch.zeros(9 * p + 64, dtype=torch.uint8)
    ends = torch.zeros(2, dtype=torch.int64)
    for n in range(1, 10):
        for tail in (0, 5, 40):
            head = ss._head(n, tail)
            scratch = torch.zeros(head + n * p, dtype=torch.uint8)
            block = arena.alloc(head + n * p, view=False)
            b = ss.stored_view(block)
            for parity in (0, 1):
                for fp16 in (False, True):
                    for shift in (0, 2, 16):
                        src = raw[shift:shift + n * p + tail]
                        check(*ss.encode_at(src.data_ptr(), scratch.data_ptr(), ends.data_ptr(),
                                            n, head, parity, fp16),
                              ss._encode_args(src, scratch, ends, n, p, head, parity))
                check(*ss.pack_at(scratch.data_ptr(), block.addr, ends.data_ptr(), parity, head),
                      (scratch, b, ends, parity, head // 8))
            for shift in (0, 2):
                out = raw[shift:shift + n * p].view(n, p)
                status = torch.zeros(n, dtype=torch.int32)
                for total in (n * p, 16 * n):
                    rel, sizes, kinds = ss._meta(b, n)
                    check(*ss.decode_at(block.addr, head, n, out.data_ptr(), status.data_ptr(),
                                        total),
                          (b[head:head + total], rel, sizes, kinds, out, status, total))
            arena.free(block)


# ---------------------------------------------------------------------------------- GPU


@gpu
@pytest.mark.gpu
def test_gpu_small_tensors_take_the_direct_path(gen):
    """On the GPU a tensor of one batch or less takes the kernel-only store, a larger one the
    ring; both restore exact, to the GPU and to the CPU, with odd sizes and dtypes."""
    with PageCompressor(batch_pages=8) as pc:
        xs = [file_pages("text", 8, 4096, gen).reshape(-1).cuda(),
              torch.randn(5 * 2048 + 7, generator=gen).to(torch.bfloat16).cuda(),
              torch.randn(3, 1001, generator=gen).cuda(),
              file_pages("text", 9, 4096, gen).reshape(-1).cuda()]
        hs = [pc.offload(x) for x in xs]
        assert [h._storage.direct for h in hs] == [True, True, True, False]
        assert hs[1].codec == "exp"
        for x, h in zip(xs, hs):
            out = torch.full_like(x, 3)
            assert torch.equal(pc.restore(h, out=out, check=True).view(torch.uint8),
                               x.view(torch.uint8))
            assert torch.equal(pc.restore(h, device="cpu").view(torch.uint8),
                               x.cpu().view(torch.uint8))
            h.wait()
            assert h.state == "ready" and h.stored_nbytes > 0
        s = pc.stats()
        assert s["direct"]["offloads"] == 3
        assert s["device_pool_bytes"] >= s["direct"]["scratch_bytes"] > 0


@gpu
@pytest.mark.gpu
def test_gpu_restore_behind_a_busy_producer_and_consumer(gen):
    """The offload reads the tensor after the caller's queued work, and the restore writes
    after the consumer's queued work into memory the consumer used (no host sync)."""
    with PageCompressor(batch_pages=64) as pc:
        for _ in range(3):
            x = torch.zeros(16 * 4096, dtype=torch.uint8, device="cuda")
            torch.cuda._sleep(20_000_000)
            x.copy_(file_pages("text", 16, 4096, gen).reshape(-1).cuda(non_blocking=True))
            want = x.clone()
            h = pc.offload(x)
            del x  # its memory may go to the next allocation once the store read it
            torch.cuda._sleep(20_000_000)
            out = torch.full_like(want, 0xA5)
            got = pc.restore(h, out=out)
            assert torch.equal(got, want)
        assert pc.failed_restores(wait=True) == 0


@gpu
@pytest.mark.gpu
def test_gpu_in_flight_bound_waits_and_stays_exact(gen):
    """Offloads queued behind a busy stream beyond the bound make the host wait (counted);
    every tensor still comes back exact."""
    with PageCompressor(batch_pages=8, slots=1) as pc:  # bound: 8 pages in flight
        xs = [file_pages("text", 8, 4096, gen).reshape(-1).cuda() for _ in range(6)]
        pc.restore(pc.offload(xs[0]))  # warm: the store, its pinned chunk, the kernels
        pc.synchronize()
        torch.cuda._sleep(200_000_000)  # ~0.1 s: longer than the host takes to queue all six
        hs = [pc.offload(x) for x in xs]
        assert pc.stats()["backpressure_waits"] >= 1
        for x, h in zip(xs, hs):
            assert torch.equal(pc.restore(h, check=True), x)


@gpu
@pytest.mark.gpu
def test_gpu_checksums_catch_a_corrupted_raw_page(gen):
    with PageCompressor(batch_pages=8, checksum=True) as pc:
        x = torch.randint(0, 256, (3 * 4096,), dtype=torch.uint8, device="cuda")
        h = pc.offload(x)
        h.wait()
        (sl,) = h._storage.stored.slices
        (_, blob), = pc._direct.store.arena.pieces(sl.base, sl.total)
        blob[int(sl.rel[1]) + 7] ^= 1
        with pytest.raises(CorruptPageError, match="checksum mismatch") as exc:
            pc.restore(h, check=True)
        assert exc.value.pages == [1]
        pc.restore(h)
        assert pc.failed_restores(wait=True) == 1


@gpu
@pytest.mark.gpu
def test_gpu_cycles_no_growth(gen):
    """2,000 offload / restore / free cycles of a 256 KiB tensor (512 MiB in all): no GPU
    memory, pinned memory or host bytes left behind."""
    from torch_pagecomp.offload._arena import CHUNK_BYTES

    pc = PageCompressor(batch_pages=64)
    x = torch.randint(0, 256, (64 * 4096,), dtype=torch.uint8, generator=gen).cuda()
    dev0, s0, s = offload_cycles(pc, x, 2000)
    assert torch.cuda.memory_allocated() <= dev0
    assert s["bytes_held_host"] == 0 and s["direct"]["host_used_bytes"] == 0
    assert s["pinned_bytes_held"] <= s0["pinned_bytes_held"] + CHUNK_BYTES  # chunks reused
    assert s["direct"]["offloads"] == 2050
    pc.close()


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_small_store_exact_behind_busy_streams(gen, dtype):
    """A small 16-bit float tensor (sizes from one element to SMALL_BYTES, odd ones among
    them) offloaded after the producer's queued work and restored after the consumer's, into
    memory the consumer used: exact, statuses clean, blocks trimmed, nothing held after
    free."""
    from torch_pagecomp._direct import SMALL_BYTES, SmallStorage

    with PageCompressor(batch_pages=2048) as pc:
        for n in (1, 2047, 2048, 256 * 1024 + 5, SMALL_BYTES // 2):
            want = _floats(gen, n, dtype).cuda()
            x = torch.zeros_like(want)
            torch.cuda._sleep(20_000_000)
            x.copy_(want)
            h = pc.offload(x)
            assert isinstance(h._storage, SmallStorage)
            del x  # its memory may be reused once the store read it
            torch.cuda._sleep(20_000_000)
            out = torch.full_like(want, 3.0)
            got = pc.restore(h, out=out)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16))
            assert torch.equal(pc.restore(h, device="cpu").view(torch.int16),
                               want.cpu().view(torch.int16))
            h.wait()
            if n >= 2048:
                assert 0 < h.stored_nbytes < 2 * n
            h.free()
        pc.synchronize()
        d = pc.stats()["direct"]
        assert pc.failed_restores(wait=True) == 0
        assert d["small_host_used_bytes"] == 0 and d["small_scratch_bytes"] > 0


@gpu
@pytest.mark.gpu
def test_gpu_small_store_cycles_no_growth(gen):
    """2,000 offload / restore / free cycles of a 1 MiB bf16 tensor: no GPU memory, pinned
    memory or host bytes left behind."""
    from torch_pagecomp.offload._small_store import CHUNK_BYTES

    pc = PageCompressor(batch_pages=256)
    x = _floats(gen, 512 * 1024, torch.bfloat16).cuda()
    dev0, s0, s = offload_cycles(pc, x, 2000)
    assert torch.cuda.memory_allocated() <= dev0
    assert s["bytes_held_host"] == 0 and s["direct"]["small_host_used_bytes"] == 0
    assert s["pinned_bytes_held"] <= s0["pinned_bytes_held"] + CHUNK_BYTES
    pc.close()
