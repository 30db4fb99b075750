"""The C page loops that take their ranges themselves (#25): ``_native.decode_pages`` /
``compress_pages`` (and the exponent codec's ``exp_encode_pages`` / ``exp_decode_pages``) take
range after range from a counter shared by every thread of a CPU batch, with the GIL released.
The batch's threads are started by the C call itself (``threads``: one call per batch), or,
where the module cannot (``THREADS`` 0), each thread of the CPU codec's pool makes one call.
Split over 1, 2, 3 and 8 threads, with ranges far smaller than the batch, the pages, sizes,
kinds and statuses are those of one thread (and of the python-lz4 path); every range is taken
exactly once, by C threads and by Python threads sharing a counter, including when the counter
starts past some ranges; errors come out as before. Skipped where ``_native`` is not built
(the Python paths take ranges one ``fn`` call at a time, unchanged)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from pages import mixed_pages, run_pages
from test_codec_cpu import hostile_metadata

import torch_pagecomp as pc
from torch_pagecomp import cpu_codec
from torch_pagecomp import format as fmt

pytestmark = pytest.mark.skipif(not cpu_codec._SHARED_RANGES,
                                reason="torch_pagecomp._native is not built here")
THREADS = (1, 2, 3, 8)


class Recording:
    """``_native`` with its page loops' calls counted (the rest passed through)."""

    def __init__(self, native):
        self._native, self.calls, self._lock = native, [], threading.Lock()

    def __getattr__(self, name):
        fn = getattr(self._native, name)
        if not name.endswith("_pages"):
            return fn

        def call(*args):
            with self._lock:  # (name, thread, arguments, the call's threads: its last one)
                self.calls.append((name, threading.get_ident(), len(args), args[-1]))
            return fn(*args)

        return call


@pytest.fixture
def small_ranges(monkeypatch):
    """Ranges of at most ``MIN_THREADED_PAGES // 2`` pages (32 of 4 KiB; the C loops cut
    ``C_RANGE_BYTES`` ranges, 16 pages), the calls recorded."""
    monkeypatch.setattr(cpu_codec, "MAX_RANGE_BYTES", 4096)
    rec = Recording(cpu_codec._native)
    monkeypatch.setattr(cpu_codec, "_native", rec)
    yield rec
    cpu_codec.set_cpu_threads(None)


def used_threads(n: int, threads: int) -> int:
    """Threads ``_run_ranges`` uses for a batch of ``n`` pages with ``threads`` set."""
    least = cpu_codec.MIN_THREADED_PAGES // 2
    return min(threads, n // least) if n >= cpu_codec.MIN_THREADED_PAGES else 1


def expected_calls(n: int, threads: int) -> int:
    """Calls of one C loop for a batch of ``n`` pages: one that starts the batch's threads
    itself, else one per thread of the pool."""
    return 1 if cpu_codec._C_THREADS else used_threads(n, threads)


def check_calls(calls: list, name: str, n: int, threads: int, nargs: int) -> None:
    """``calls`` (recorded) are one batch's calls of C loop ``name`` with ``nargs`` arguments,
    the last the threads that call runs on: the batch's threads in all."""
    assert {c[0] for c in calls} == {name}, calls
    assert len(calls) == expected_calls(n, threads) and all(c[2] == nargs for c in calls), calls
    assert sum(c[3] for c in calls) == used_threads(n, threads), calls


@pytest.mark.parametrize("packed", [False, True])
def test_decode_over_threads_with_small_ranges(gen, packed, small_ranges, monkeypatch):
    """Hostile metadata spread over ten ranges: the same pages and statuses with 1, 2, 3 and 8
    threads, one C call per thread, as the python-lz4 path's."""
    payload, offsets, sizes, kinds = hostile_metadata(gen, packed)
    n = sizes.shape[0]
    assert n == 300  # 10 ranges of 30
    results = []
    for threads in THREADS:
        cpu_codec.set_cpu_threads(threads)
        small_ranges.calls.clear()
        results.append(cpu_codec.decompress_cpu(payload, offsets, sizes, kinds, 4096))
        check_calls(small_ranges.calls, "decode_pages", n, threads, 12)
    out1, st1 = results[0]
    bad = st1.numpy() != 0
    assert bad.sum() >= 50 and len(set((np.flatnonzero(bad) // 30).tolist())) == 10
    assert not out1[torch.from_numpy(bad)].any()
    for threads, (out, st) in zip(THREADS, results):
        assert torch.equal(st, st1), threads
        assert torch.equal(out, out1), threads
    with monkeypatch.context() as m:
        m.setattr(cpu_codec, "_native", None)
        ref_out, ref_st = cpu_codec.decompress_cpu(payload, offsets, sizes, kinds, 4096)
    assert torch.equal(ref_st, st1) and torch.equal(ref_out, out1)


@pytest.mark.parametrize("element_size", [1, 2])
def test_compress_over_threads_with_small_ranges(gen, element_size, small_ranges):
    """The same payload, sizes and kinds with 1, 2, 3 and 8 threads (FILL, RAW and LZ4 pages
    in every range; bf16 bit-shuffled in C), one C call per thread, and they decode back."""
    if element_size == 1:
        pages = torch.cat([mixed_pages(280, 4096, gen), run_pages(9, 4096, gen)])
    else:
        x = torch.relu(torch.randn(289 * 2048, generator=gen)).to(torch.bfloat16)
        pages = x.view(torch.uint8).view(-1, 4096).clone()
        pages[::17] = 0  # FILL pages here and there
    n = pages.shape[0]
    results = []
    for threads in THREADS:
        cpu_codec.set_cpu_threads(threads)
        small_ranges.calls.clear()
        results.append([t.clone() for t in cpu_codec.compress_cpu(pages, element_size)])
        check_calls(small_ranges.calls, "compress_pages", n, threads, 13)
    for threads, r in zip(THREADS, results):
        assert all(torch.equal(u, v) for u, v in zip(r, results[0])), threads
    payload, sizes, kinds = results[0]
    assert (kinds == fmt.KIND_FILL).any() and (kinds & 15 == fmt.KIND_LZ4).any()
    out, st = cpu_codec.decompress_cpu(payload.view(-1), torch.arange(n) * 4096, sizes, kinds,
                                       4096)
    assert torch.equal(out, pages) and not st.any()


@pytest.mark.parametrize("n, page_size", [(64, 4096), (5000, 4096), (300, 1 << 17)])
def test_c_loops_take_small_ranges(monkeypatch, n, page_size):
    """A C loop is handed ranges of at most ``C_RANGE_BYTES`` (one page where a page is larger):
    with a few megabyte ranges per thread the threads idled behind the last one (#25)."""
    monkeypatch.setattr(cpu_codec, "cpu_threads", lambda: 8)
    got = []
    cpu_codec._run_ranges(None, n, page_size,
                          lambda counter, parts, threads: got.append((parts, threads)))
    parts = got[0][0]
    assert len(got) == expected_calls(n, 8) and {g[0] for g in got} == {parts}
    assert sum(g[1] for g in got) == used_threads(n, 8)
    assert parts <= n and -(-n // parts) * page_size <= max(cpu_codec.C_RANGE_BYTES, page_size)


@pytest.mark.skipif(not cpu_codec._C_THREADS, reason="the C loops start no threads here")
def test_more_threads_than_the_c_loops_start(gen, monkeypatch):
    """``set_cpu_threads`` above the C loops' ``MAX_THREADS``: a batch runs on as many as they
    start (a ValueError from the C call before), and round-trips."""
    cap = cpu_codec._native.MAX_THREADS
    got = []
    monkeypatch.setattr(cpu_codec, "cpu_threads", lambda: cap + 44)
    cpu_codec._run_ranges(None, 1 << 16, 4096, lambda c, parts, threads: got.append(threads))
    assert got == [cap]
    pages = mixed_pages((cap + 44) * cpu_codec.MIN_THREADED_PAGES // 2, 4096, gen)
    c = pc.compress(pages, backend="cpu")
    assert torch.equal(pc.decompress(c, backend="cpu"), pages)


def test_c_errors_come_out_as_before(gen, small_ranges):
    """Buffers that do not describe one batch: the C loop's ValueError, with 1 and 3 threads."""
    c = pc.compress(mixed_pages(300, 4096, gen), backend="cpu")
    for threads in (1, 3):
        cpu_codec.set_cpu_threads(threads)
        with pytest.raises(ValueError, match="decode_pages: 300 pages"):
            cpu_codec.decompress_cpu(c.payload.view(-1), torch.arange(300) * 4096, c.sizes,
                                     c.kinds[:-1], 4096)


def bounds(n: int, parts: int) -> list[int]:
    return [n * k // parts for k in range(parts + 1)]


# (threads, whether the C call starts them): Python threads each making a call, or one call
SHARING = [(1, False), (3, False), (3, True), (8, True)]


def run_shared(call, parts: int, first: int, threads: int, c_threads: bool) -> np.ndarray:
    """``call(counter, parts, threads)`` once with ``c_threads`` (the call starts its threads),
    else ``call(counter, parts, 1)`` on ``threads`` Python threads, sharing a counter at
    ``first``; the counter afterwards."""
    counter = np.full(1, first, dtype=np.int64)
    if c_threads:
        call(counter, parts, threads)
        return counter
    workers = [threading.Thread(target=call, args=(counter, parts, 1)) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return counter


@pytest.mark.parametrize("threads, c_threads", SHARING)
@pytest.mark.parametrize("packed", [False, True])
def test_decode_takes_each_range_once(gen, packed, threads, c_threads):
    """A counter that starts at range 4 of 13 (uneven ranges of ``n * k // parts``): exactly
    the pages of ranges 4..12 are written, as separate calls write them, the rest untouched;
    the counter ends at ``parts`` plus one draw past the end per thread (each range drawn
    once, and every thread the call started ran)."""
    native = cpu_codec._native
    payload, offsets, sizes, kinds = (t.numpy() for t in hostile_metadata(gen, packed))
    n, parts, first = sizes.shape[0], 13, 4
    b = bounds(n, parts)
    want_out = np.full(n * 4096, 0xA5, np.uint8)
    want_st = np.full(n, -1, np.int32)
    for k in range(first, parts):
        native.decode_pages(payload, offsets, sizes, kinds, want_out, want_st, 4096, b[k],
                            b[k + 1])
    out = np.full(n * 4096, 0xA5, np.uint8)
    st = np.full(n, -1, np.int32)

    def call(counter, parts, t):
        native.decode_pages(payload, offsets, sizes, kinds, out, st, 4096, 0, n, counter, parts,
                            t)

    counter = run_shared(call, parts, first, threads, c_threads)
    assert counter[0] == parts + threads
    assert np.array_equal(st, want_st) and np.array_equal(out, want_out)
    assert (st[:b[first]] == -1).all() and (st[b[first]:] != -1).all()
    assert (st[b[first]:] != 0).any()  # hostile pages among those taken
    # a sub-span: ranges of start .. stop, the counter past the end takes nothing
    st[:] = -1
    native.decode_pages(payload, offsets, sizes, kinds, out, st, 4096, 50, 110,
                        np.zeros(1, np.int64), 7)
    assert (st[50:110] != -1).all() and (st[:50] == -1).all() and (st[110:] == -1).all()
    st[:] = -1
    native.decode_pages(payload, offsets, sizes, kinds, out, st, 4096, 0, n,
                        np.full(1, 7, np.int64), 7)
    assert (st == -1).all()


@pytest.mark.parametrize("threads, c_threads", SHARING)
def test_compress_takes_each_range_once(gen, threads, c_threads):
    native = cpu_codec._native
    raw = mixed_pages(200, 4096, gen).numpy().reshape(-1)
    n, parts, first = 200, 9, 2
    b = bounds(n, parts)
    args = (4096, fmt.lz4_keep_limit(4096), fmt.KIND_LZ4, 0, cpu_codec._liblz4_calls())
    want = [np.full(n * 4096, 0xA5, np.uint8), np.full(n, -1, np.int32), np.full(n, 0xA5, np.uint8)]
    for k in range(first, parts):
        lo, hi = b[k] * 4096, b[k + 1] * 4096
        native.compress_pages(raw[lo:hi], raw[lo:hi], want[0][lo:hi], want[1][b[k]:b[k + 1]],
                              want[2][b[k]:b[k + 1]], *args)
    got = [np.full(n * 4096, 0xA5, np.uint8), np.full(n, -1, np.int32), np.full(n, 0xA5, np.uint8)]
    counter = run_shared(lambda c, p, t: native.compress_pages(raw, raw, *got, *args, c, p, t),
                         parts, first, threads, c_threads)
    assert counter[0] == parts + threads
    assert all(np.array_equal(u, v) for u, v in zip(got, want))
    assert (got[1][:b[first]] == -1).all() and (got[1][b[first]:] > 0).all()


@pytest.mark.skipif(not hasattr(cpu_codec._native, "exp_encode_pages"),
                    reason="built without the exponent loops")
@pytest.mark.parametrize("threads, c_threads", SHARING)
def test_exp_loops_take_each_range_once(gen, threads, c_threads):
    """``exp_encode_pages`` / ``exp_decode_pages`` with a shared counter: the ranges from the
    counter on, each once, as separate calls on those ranges write them."""
    from test_exp_codec import hostile_batch

    native = cpu_codec._native
    x = torch.randn(150 * 2048, generator=gen).to(torch.bfloat16)
    raw = x.view(torch.uint8).view(-1, 4096).clone()
    raw[::11] = 0
    raw = raw.numpy().reshape(-1)
    n, parts, first = 150, 8, 3
    b = bounds(n, parts)
    want = [np.full(n * 4096, 0xA5, np.uint8), np.full(n, -1, np.int32), np.full(n, 0xA5, np.uint8)]
    for k in range(first, parts):
        lo, hi = b[k] * 4096, b[k + 1] * 4096
        native.exp_encode_pages(raw[lo:hi], want[0][lo:hi], want[1][b[k]:b[k + 1]],
                                want[2][b[k]:b[k + 1]], 4096, fmt.EXP_BF16)
    got = [np.full(n * 4096, 0xA5, np.uint8), np.full(n, -1, np.int32), np.full(n, 0xA5, np.uint8)]
    counter = run_shared(
        lambda c, p, t: native.exp_encode_pages(raw, *got, 4096, fmt.EXP_BF16, c, p, t),
        parts, first, threads, c_threads)
    assert counter[0] == parts + threads
    assert all(np.array_equal(u, v) for u, v in zip(got, want))
    assert (got[1][:b[first]] == -1).all() and (got[1][b[first]:] > 0).all()

    payload, offsets, sizes, kinds = (t.numpy() for t in hostile_batch(gen))
    n = sizes.shape[0]
    offsets = np.ascontiguousarray(offsets[:n])
    parts, first = min(n, 6), 1
    b = bounds(n, parts)
    want_out, want_st = np.full(n * 4096, 0xA5, np.uint8), np.full(n, -1, np.int32)
    for k in range(first, parts):
        s = slice(b[k], b[k + 1])
        native.exp_decode_pages(payload, offsets[s], sizes[s], kinds[s],
                                want_out[b[k] * 4096:b[k + 1] * 4096], want_st[s], 4096)
    out, st = np.full(n * 4096, 0xA5, np.uint8), np.full(n, -1, np.int32)
    counter = run_shared(lambda c, p, t: native.exp_decode_pages(payload, offsets, sizes, kinds,
                                                                 out, st, 4096, c, p, t),
                         parts, first, threads, c_threads)
    assert counter[0] == parts + threads
    assert np.array_equal(st, want_st) and np.array_equal(out, want_out)
    assert (st[b[first]:] != 0).any() and (st[b[first]:] == 0).any()


def test_counter_arguments_are_checked():
    """A counter that is not a writable, aligned int64 of at least one item, or parts outside
    1..2**31 - 1: a TypeError / ValueError before anything is written."""
    native = cpu_codec._native
    payload = np.zeros(4096, np.uint8)
    off, size = np.zeros(1, np.int64), np.full(1, 4096, np.int32)
    kinds, out, st = np.zeros(1, np.uint8), np.full(4096, 0xA5, np.uint8), np.full(1, -1, np.int32)

    def dec(counter, parts=1):
        native.decode_pages(payload, off, size, kinds, out, st, 4096, 0, 1, counter, parts)

    for bad in (np.zeros(1, np.int32), np.zeros(1, np.uint64), np.zeros(4, np.int64)[::2]):
        with pytest.raises(TypeError, match="counter"):
            dec(bad)
    ro = np.zeros(1, np.int64)
    ro.flags.writeable = False
    with pytest.raises(TypeError, match="counter"):
        dec(ro)
    unaligned = np.frombuffer(bytearray(16), dtype=np.int64, count=1, offset=1)
    for counter, parts in ((np.zeros(0, np.int64), 1), (unaligned, 1),
                           (np.zeros(1, np.int64), 0), (np.zeros(1, np.int64), 2**31)):
        with pytest.raises(ValueError, match="counter must be"):
            dec(counter, parts)
    # threads: 1..256, more than one only with a counter (the start .. stop range is one)
    for counter, threads in ((np.zeros(1, np.int64), 0), (np.zeros(1, np.int64), 257),
                             (None, 2)):
        with pytest.raises(ValueError, match="threads must be"):
            native.decode_pages(payload, off, size, kinds, out, st, 4096, 0, 1, counter, 1,
                                threads)
    assert (out == 0xA5).all() and (st == -1).all()
    dec(None)  # no counter: start .. stop, as before
    assert st[0] == 0 and not out.any()


def test_exp_codec_over_threads_with_small_ranges(gen, small_ranges, monkeypatch):
    """The exponent codec's CPU path (``exp_codec``) the same way: 1, 2, 3 and 8 threads give
    the same payload, sizes, kinds, pages and statuses (hostile pages among them), one call of
    each C loop per thread, and the batch decodes back."""
    from torch_pagecomp import exp_codec

    monkeypatch.setattr(exp_codec, "_native", small_ranges)  # imported by name there
    x = (torch.randn(289 * 2048, generator=gen) * 0.02).to(torch.bfloat16)
    pages = x.view(torch.uint8).view(-1, 4096).clone()
    pages[::13] = 0  # FILL pages here and there
    n = pages.shape[0]
    encoded, decoded = [], []
    for threads in THREADS:
        cpu_codec.set_cpu_threads(threads)
        small_ranges.calls.clear()
        payload, sizes, kinds = (t.clone() for t in exp_codec.compress_exp_cpu(pages,
                                                                               fmt.EXP_BF16))
        offsets = torch.arange(n, dtype=torch.int64) * 4096
        hostile = sizes.clone()  # hostile sizes in several ranges (the same each round)
        g = torch.Generator().manual_seed(n)
        hostile[torch.randint(0, n, (9,), generator=g)] = torch.randint(
            -5, 9000, (9,), generator=g, dtype=torch.int32)
        got = exp_codec.decompress_exp_cpu(payload.view(-1), offsets, hostile, kinds, 4096)
        calls = small_ranges.calls
        check_calls([c for c in calls if c[0] == "exp_encode_pages"], "exp_encode_pages", n,
                    threads, 9)
        check_calls([c for c in calls if c[0] == "exp_decode_pages"], "exp_decode_pages", n,
                    threads, 10)
        encoded.append((payload, sizes, kinds))
        decoded.append(tuple(t.clone() for t in got))
        assert decoded[-1][1].any()  # some of the hostile pages failed
    ref = exp_codec.compress_exp_cpu(pages, fmt.EXP_BF16, native=False)
    assert all(torch.equal(u, v) for u, v in zip(encoded[0], ref))
    ref_pages, ref_status = exp_codec.decompress_exp_cpu(
        encoded[0][0].view(-1), offsets, hostile, encoded[0][2], 4096, native=False)
    assert torch.equal(decoded[0][1], ref_status) and torch.equal(decoded[0][0], ref_pages)
    ok = ref_status == 0
    assert torch.equal(decoded[0][0][ok], pages[ok])
    for threads, enc, dec in zip(THREADS, encoded, decoded):
        assert all(torch.equal(u, v) for u, v in zip(enc, encoded[0])), threads
        assert all(torch.equal(u, v) for u, v in zip(dec, decoded[0])), threads
