"""The compressed activation store: kernels place pages in a virtual arena of host chunks.

On the CPU the store's kernels (compress, plan, pack-to-host) run under the Triton interpreter
on plain CPU tensors standing in for page-locked memory, so CI exercises the same placement,
packing and restore logic as the GPU; GPU tests run it on CUDA streams.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from conftest import POISON

from torch_pagecomp.kernels.host_pack import ALIGN, fetch_from_host, pack_slice
from torch_pagecomp.offload._arena import slice_upper
from torch_pagecomp.offload._paged import PagedStore

P = 4096
CUDA = torch.cuda.is_available()
# CPU tensors stand in for page-locked memory only under the interpreter
interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU stand-ins need the Triton interpreter")


def _data(gen: torch.Generator, nbytes: int, kind: str) -> torch.Tensor:
    """Compressible bytes of a few shapes: small symbols, bf16-like, fill and noise pages."""
    if kind == "noise":
        return torch.randint(0, 256, (nbytes,), generator=gen, dtype=torch.uint8)
    if kind == "bf16":
        n = nbytes // 2 + 1
        x = (torch.randn(n, generator=gen) * 0.02).to(torch.bfloat16)
        return x.view(torch.uint8)[:nbytes].clone()
    out = torch.randint(0, 4, (nbytes,), generator=gen, dtype=torch.uint8)
    out[: nbytes // 3] = 9  # a run of fill pages
    return out


def _store(device="cpu", chunk=1 << 16, slice_bytes=1 << 14, checksum=False) -> PagedStore:
    streams = (None, None, None)
    if device != "cpu":
        streams = tuple(torch.cuda.Stream() for _ in range(3))
    return PagedStore(torch.device(device), P, streams, chunk_bytes=chunk,
                      slice_bytes=slice_bytes, checksum=checksum)


def _restored(store: PagedStore, stored, like: torch.Tensor) -> torch.Tensor:
    """``stored`` restored on the store's restore stream into a poisoned tensor like ``like``,
    the current stream waiting for it."""
    out = torch.full_like(like, POISON)
    store.restore_stream.wait_stream(torch.cuda.current_stream())  # after the poison
    with torch.cuda.stream(store.restore_stream):
        store.restore(stored, out)
    torch.cuda.current_stream().wait_stream(store.restore_stream)
    return out


@interpreter
@pytest.mark.parametrize("element_size", [1, 2, 4])
@pytest.mark.parametrize("kind", ["small", "bf16", "noise"])
def test_round_trip_across_slices_and_chunks(gen, element_size, kind):
    """Storages of odd sizes (a raw tail), several slices each, over chunk boundaries."""
    store = _store()
    sizes = [int(torch.randint(1, 9 * P, (), generator=gen)) for _ in range(5)] + [3 * P]
    srcs = [_data(gen, n, kind) for n in sizes]
    stored = [store.offload(s, element_size) for s in srcs]
    store.poll()
    for s, st in zip(srcs, stored):
        out = torch.full_like(s, POISON)
        store.restore(st, out)
        assert torch.equal(out, s)
        # each page padded; each slice's metadata behind its pages (maybe in the next chunk)
        assert st.host_nbytes() <= s.numel() + (s.numel() // P) * ALIGN + sum(
            slice_upper(sl.n, P, False) - sl.n * P for sl in st.slices)
    used = store.arena.used
    assert used == sum(sum(sl.total for sl in st.slices) for st in stored)
    for st in stored:
        store.free(st)
    assert store.arena.used == 0 and not store.arena.live
    assert store.stats()["host_peak_used_bytes"] == used  # exact: placed sizes, all live at once


@interpreter
def test_slices_take_their_payloads_from_a_ring_that_follows_their_size(gen, monkeypatch):
    """Each slice's fixed-stride payload is a buffer reused while a slice needs at most what
    it holds and at least half of it (no allocation per slice), made again otherwise (a ring
    kept at the largest slice held it through the forward); storages of varying sizes come
    back exactly, and ``release_payloads`` lets the ring go (the next slice makes it again).
    Run with both buffers taken in turn, the general case (the package takes the second only
    while the link is behind: its own test below)."""
    from torch_pagecomp.offload import _paged

    def in_turn(store, nbytes):
        slot = min(store._slots, key=lambda s: s.used)
        store._uses += 1
        slot.used = store._uses
        return slot

    monkeypatch.setattr(_paged.PagedStore, "_slot", in_turn)
    store = _store(slice_bytes=4 * P)
    ptrs = []

    def ring() -> list:
        return [slot.buf for slot in store._slots]

    def store_pages(pages: int, extra: int = 0):
        s = _data(gen, pages * P + extra, "bf16")
        stored = store.offload(s, 2)
        ptrs.append([b.data_ptr() if b is not None else None for b in ring()])
        return s, stored

    kept = [store_pages(8), store_pages(8)]  # slices of 4 pages: both buffers 4 pages
    assert len(ring()) == _paged.SCRATCH_SLICES
    assert all(b.numel() == 4 * P for b in ring()) and ptrs[0] == ptrs[1]
    kept.append(store_pages(6, 5))  # 4 + 2 pages: 2 is half of 4, still reused
    assert ptrs[2] == ptrs[1]
    kept.append(store_pages(1))  # a slice of 1 page: less than half, made again at 1
    assert sorted(b.numel() for b in ring()) == [P, 4 * P]
    store.release_payloads()
    assert all(b is None for b in ring())
    kept.append(store_pages(3))
    store.poll()
    for s, st in kept:
        out = torch.full_like(s, POISON)
        store.restore(st, out)
        assert torch.equal(out, s)


@interpreter
@pytest.mark.parametrize("float_format", [None, "bf16"])
def test_a_second_payload_only_while_the_first_holds_pages_not_sent(gen, monkeypatch,
                                                                 float_format):
    """The store's payloads: the first, and a second only while the first still holds pages
    that have not left it (the link behind; an exponent-coded slice's are sent once the host
    has read its placement, so a tensor's next slice takes the second) and only under the
    GPU's peak of the last step (``_below_peak``, stood in for here: no GPU), let go once
    ``IDLE_SLICES`` slices in a row found the first free, or once idle and over that peak;
    ``scratch_bytes`` bounds both. Every slice comes back exactly, with either codec."""
    from torch_pagecomp.offload import _arena, _paged

    assert _paged.SCRATCH_SLICES == 2
    store = _store(slice_bytes=4 * P)
    assert not store._below_peak(0)  # no step ended (and no GPU)
    under = [True]
    monkeypatch.setattr(PagedStore, "_below_peak", lambda self, nbytes: under[0])
    first, second = store._slots
    srcs, stored = [], []

    def offload(pages):
        srcs.append(_data(gen, pages * P + 3, "bf16"))
        stored.append(store.offload(srcs[-1], 2, float_format=float_format))
        store.poll()  # (as the hooks do before each saved tensor)
        return stored[-1].slices

    slices = offload(8)
    assert first.last is (slices[0] if float_format else slices[1])
    # LZ4's pages leave at once on the CPU; an exponent-coded slice's once the host reads
    # its placement, after the next slice took the second payload
    assert (second.last is slices[1]) == bool(float_format)
    assert store.stats()["scratch_bytes"] == 2 * 4 * P
    with monkeypatch.context() as behind:
        behind.setattr(_arena._Slice, "done", lambda sl: sl is not first.last)
        slices = offload(3)  # the link behind: the second
        assert second.last is slices[0] and second.buf is not None
    for _ in range(_paged.IDLE_SLICES):  # caught up: the first, the second let go
        assert second.buf is not None
        slices = offload(2)
        assert first.last is slices[0]
    assert second.buf is None
    under[0] = False  # over the last step's peak: the first, though the link is behind
    with monkeypatch.context() as behind:
        behind.setattr(_arena._Slice, "done", lambda sl: sl is not first.last)
        slices = offload(3)
        assert first.last is slices[0] and second.buf is None
    under[0] = True
    with monkeypatch.context() as behind:
        behind.setattr(_arena._Slice, "done", lambda sl: sl is not first.last)
        offload(3)
        assert second.buf is not None
    under[0] = False  # idle, and over the peak: let go at the next slice
    offload(1)
    assert second.buf is None
    for s, st in zip(srcs, stored):
        out = torch.full_like(s, POISON)
        store.restore(st, out)
        assert torch.equal(out, s)


@interpreter
def test_the_no_wait_probe_takes_the_other_payload_where_the_host_would_wait(gen, monkeypatch):
    """``bench.dev_ab_steps``' ``memory_no_wait`` arm: where the payload the store would pick
    holds a slice whose placement is not published (the host would wait for it), the other
    payload is taken, made over the peak rule; without the arm the first is taken again.
    Both tensors come back exactly."""
    from bench.dev_ab_steps import _arm_patch
    from torch_pagecomp.offload import _arena

    store = _store(slice_bytes=4 * P)
    first, second = store._slots
    srcs = [_data(gen, 2 * P + 7, "bf16"), _data(gen, 3 * P, "bf16")]
    stored = [store.offload(srcs[0], 2, float_format="bf16")]  # not polled: not sent yet
    assert first.last is stored[0].slices[0] and first.last.send is not None
    with monkeypatch.context() as m:
        m.setattr(_arena._Slice, "known", lambda sl: sl is not first.last)  # unpublished
        assert store._pick(2 * P) is first  # the package: no second over the peak rule
        with _arm_patch("memory_no_wait"):
            assert store._pick(2 * P) is second
            stored.append(store.offload(srcs[1], 2, float_format="bf16"))
        assert second.last is stored[1].slices[0] and second.buf is not None
    store.poll()
    for src, st in zip(srcs, stored):
        out = torch.full_like(src, POISON)
        store.restore(st, out)
        assert torch.equal(out, src)


@interpreter
def test_peak_of_stored_bytes_counts_slices_freed_before_their_placement_is_read(gen):
    """The stats' ``host_peak_used_bytes`` is the most bytes stored at once, in the order the
    host stored and freed them, at their placed sizes: a slice freed before the host read its
    placement (the hooks free a storage whose backward came first) still counts while it was
    stored, as do slices placed but not yet confirmed when others are freed."""
    store = _store(chunk=1 << 20)
    srcs = [_data(gen, int(torch.randint(2 * P, 6 * P, (), generator=gen)), "small")
            for _ in range(3)]
    stored = [store.offload(s, 1) for s in srcs]
    slices = [list(st.slices) for st in stored]  # ``free`` drops a stored tensor's slices
    assert all(sl.base is None for sls in slices for sl in sls)  # nothing confirmed yet
    store.free(stored[0])  # before its placement is read
    store.poll()
    sizes = [sum(sl.total for sl in sls) for sls in slices]
    assert all(sizes)
    assert store.arena.used == sizes[1] + sizes[2]
    assert store.stats()["host_peak_used_bytes"] == sum(sizes)
    store.free(stored[1])
    store.arena.reset_peaks()
    assert store.stats()["host_peak_used_bytes"] == sizes[2]
    extra = store.offload(srcs[0], 1)
    store.poll()
    assert store.stats()["host_peak_used_bytes"] == sizes[2] + sum(sl.total for sl in extra.slices)
    for st in (stored[2], extra):
        store.free(st)
    assert store.arena.used == 0 and not store.arena._log


def test_host_waits_for_packs_are_counted():
    """``stats()["host_wait_us"]``: the time the host spent waiting for a slice's pack (a
    confirm that needs its placement), and only that: a confirm of finished slices adds
    nothing; ``host_wait_us_by`` counts it by why the host waited (``confirm``'s ``why``)."""
    import time

    from torch_pagecomp.offload._arena import _Slice

    class SlowPack:  # a pack event that completes once waited for, 20 ms later
        def __init__(self):
            self.finished = False

        def query(self):
            return self.finished

        def synchronize(self):
            time.sleep(0.02)
            self.finished = True

    store = PagedStore(torch.device("cpu"), P, chunk_bytes=1 << 16)
    arena = store.arena
    arena.back(1 << 16, None)
    m = slice_upper(1, P, False) // 2 - P // 2  # a page's metadata, behind its 16 bytes

    def published(base: int, total: int) -> int:  # a descriptor slot the pack wrote
        k = arena.host_desc()
        arena.descs[k, :2] = torch.tensor([base, total])
        return k

    slow = _Slice(0, 1, None, host_desc=published(0, 16 + m), stored=SlowPack())
    arena.add(slow, P)
    arena.confirm()  # not finished: not waited for
    assert slow.base is None and store.stats()["host_wait_us"] == 0
    assert store.stats()["host_wait_us_by"] == {}
    arena.confirm(through=slow, why="payload")
    assert slow.base == 0 and slow.total == 16 + m
    waited = store.stats()["host_wait_us"]
    assert 20_000 <= waited < 2_000_000, waited
    assert store.stats()["host_wait_us_by"] == {"payload": waited}
    done = _Slice(1, 1, None, host_desc=published(16 + m, 16 + m))
    arena.add(done, P)
    arena.confirm(through=done, why="room")
    assert store.stats()["host_wait_us"] == waited
    assert store.stats()["host_wait_us_by"] == {"payload": waited}  # nothing waited: no row


@pytest.mark.parametrize("checksum", [False, True])
@pytest.mark.parametrize("n", [1, 3, 16, 37, 2048, 16384])
def test_metadata_addresses_are_those_of_its_views(n, checksum):
    """The GPU store launches its kernels with addresses into a slice's metadata buffer (its
    start plus ``_meta_offsets``) and makes the views only where a path needs them: each
    address is its view's, each part 16-byte aligned (a kernel is compiled per pointer
    alignment), and the parts tile the buffer without overlap."""
    from torch_pagecomp.offload._arena import (
        DESC,
        KINDS,
        REL,
        SIZES,
        SUMS,
        _meta_bytes,
        _meta_offsets,
        _Slice,
    )

    meta = torch.empty(_meta_bytes(n, checksum), dtype=torch.uint8)
    sl = _Slice(0, n, meta, checksum)
    views = {REL: sl.rel, DESC: sl.desc, SIZES: sl.sizes, KINDS: sl.kinds, SUMS: sl.sums}
    assert (views[SUMS] is None) == (not checksum)
    spans = []
    for part, view in views.items():
        if view is None:
            continue
        at = meta.data_ptr() + _meta_offsets(n, checksum)[part]
        assert at == view.data_ptr() and view.data_ptr() % 16 == 0
        spans.append((view.data_ptr() - meta.data_ptr(), view.numel() * view.element_size()))
    assert spans[1][1] == 16 and [v.numel() for v in views.values() if v is not None][2:] == \
        [n] * (3 if checksum else 2)
    spans.sort()
    assert all(a + na <= b for (a, na), (b, _) in zip(spans, spans[1:]))
    assert spans[-1][0] + spans[-1][1] <= meta.numel()


def test_chunks_must_hold_a_page():
    with pytest.raises(ValueError, match="chunk_bytes"):
        PagedStore(torch.device("cpu"), P, chunk_bytes=P // 2)
    with pytest.raises(ValueError, match="chunk_bytes"):
        PagedStore(torch.device("cpu"), P, chunk_bytes=(1 << 16) + 8)


@interpreter
@pytest.mark.parametrize("float_format", [None, "bf16"])
def test_a_store_failing_after_its_first_slices_gives_them_back(gen, monkeypatch, float_format):
    """A store that raises at its second slice (a GPU out of memory for the slice's
    metadata, an interrupt in a host wait) gives back the slice it stored first: it had no
    owner, its chunk stayed live, and the arena never unpinned it. Later stores round-trip and
    the arena comes back empty."""
    store = _store()  # 4 pages a slice
    real, calls = store._store_slice, {"n": 0}

    def second_fails(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected: the second slice fails")
        return real(*args, **kwargs)

    monkeypatch.setattr(store, "_store_slice", second_fails)
    with pytest.raises(RuntimeError, match="second slice"):
        store.offload(_data(gen, 8 * P + 5, "bf16"), 2, float_format=float_format)
    monkeypatch.setattr(store, "_store_slice", real)
    for _ in range(3):
        src = _data(gen, 6 * P + 77, "bf16")
        st = store.offload(src, 2, float_format=float_format)
        store.poll()
        out = torch.full_like(src, POISON)
        store.restore(st, out)
        assert torch.equal(out, src)
        store.free(st)
    store.wait_placed()
    store.poll()
    assert store.stats()["host_used_bytes"] == 0
    store.arena.release_idle()
    assert store.arena.held_bytes == 0


@interpreter
def test_chunks_are_reused_and_host_memory_stays_bounded(gen):
    """Offload and free many times: the arena's end moves on, chunks behind it come back."""
    store = _store(chunk=1 << 15, slice_bytes=1 << 13)
    held, placed = [], 0
    for _ in range(12):
        srcs = [_data(gen, 5 * P + 123, "small") for _ in range(3)]
        stored = [store.offload(s, 1) for s in srcs]
        store.poll()
        for s, st in zip(srcs, stored):
            out = torch.empty_like(s)
            store.restore(st, out)
            assert torch.equal(out, s)
            placed += sum(sl.total for sl in st.slices)
            store.free(st)
        held.append(store.arena.held_bytes)
    end = int(store.arena.state[store.arena.parity])
    assert end == placed and end > 5 * (1 << 15)  # end to end, many chunks on
    assert max(held[4:]) <= max(held[:4]), held


@interpreter
def test_slices_fill_the_arena_end_to_end_across_chunks(gen):
    """Slices follow each other without gaps, across chunk boundaries: the arena backs the
    compressed bytes, not a chunk per slice's worst case. A chunk shared by two tensors stays
    backed until both are freed; the bytes of each come back exactly."""
    chunk = 1 << 15  # 8 pages
    store = _store(chunk=chunk, slice_bytes=chunk)
    arena = store.arena
    kinds = ["noise", "small", "bf16", "noise", "small"]
    srcs = [_data(gen, int(torch.randint(3 * P, 8 * P, (), generator=gen)) // P * P, k)
            for k in kinds]
    stored = [store.offload(s, 2) for s in srcs]
    store.wait_placed()
    slices = [sl for st in stored for sl in st.slices]
    ends = [sl.base + sl.total for sl in slices]
    assert [sl.base for sl in slices] == [0] + ends[:-1]  # end to end
    assert arena.used == ends[-1] and arena.frontier == ends[-1]
    assert set(arena.chunks_of(0, ends[-1])) <= set(arena.backed)
    crossing = [sl for sl in slices if len(arena.chunks_of(sl.base, sl.total)) > 1]
    assert crossing  # noise pages are stored raw: the first slices pass a boundary
    for s, st in zip(srcs, stored):
        out = torch.full_like(s, POISON)
        store.restore(st, out)
        assert torch.equal(out, s)
    # free the first tensor: only chunks no other slice touches go back
    shared = arena.chunks_of(stored[1].slices[0].base, 1)[0]
    store.free(stored[0])
    assert shared in arena.backed
    assert not set(range(shared)) & set(arena.backed)  # the first tensor's other chunks
    out = torch.full_like(srcs[1], POISON)
    store.restore(stored[1], out)  # its first chunk was shared: still there
    assert torch.equal(out, srcs[1])
    for st in stored[1:]:
        store.free(st)
    assert arena.used == 0 and not arena.live
    assert min(arena.backed) == arena.frontier // chunk  # none behind the end's chunk


@interpreter
def test_slices_in_flight_are_waited_for_before_a_new_chunk_is_pinned(gen, monkeypatch):
    """Many tensors stored before any poll (a host running ahead of the pack stream): the
    arena pins chunks for the bytes placed and one slice's worst case, not for the worst
    case of every slice in flight (which is as large as the uncompressed bytes)."""
    chunk = 1 << 15
    store = _store(chunk=chunk, slice_bytes=1 << 13)
    arena = store.arena
    waited = []
    real = arena.confirm

    def counting(through=None, why="caller"):
        waited.append(through is not None)
        real(through, why)

    monkeypatch.setattr(arena, "confirm", counting)
    srcs = [_data(gen, 5 * P, "small") for _ in range(14)]  # 70 pages: 8.75 chunks raw
    stored = [store.offload(s, 1) for s in srcs]
    assert any(waited)  # the host waited for slices in flight instead of pinning for them
    assert arena.pending_upper == sum(upper for _, upper in arena.pending) > 0
    store.wait_placed()
    worst = (1 << 13)  # one slice's worst case
    assert len(arena.backed) <= (arena.used + worst) // chunk + 2, (len(arena.backed), arena.used)
    assert len(arena.backed) * chunk < sum(s.numel() for s in srcs) // 2  # compressible data
    for s, st in zip(srcs, stored):
        out = torch.full_like(s, POISON)
        store.restore(st, out)
        assert torch.equal(out, s)


@interpreter
def test_the_nowait_probe_pins_instead_of_waiting_and_puts_the_wait_back(gen, monkeypatch):
    """``bench.dev_ab_steps``' arm ``memory_nowait``: while its steps run, a store that
    needs more chunks than are free pins them instead of waiting for the slices in flight
    (here a wait raises); every tensor still comes back; after it, the store waits again."""
    from bench.dev_ab_steps import _arm_patch

    chunk = 1 << 15
    store = _store(chunk=chunk, slice_bytes=1 << 13)
    arena = store.arena

    class Waited(Exception):
        pass

    real = arena.confirm

    def behind(through=None, why="caller"):
        if through is not None:
            raise Waited
        real()

    monkeypatch.setattr(arena, "confirm", behind)
    srcs = [_data(gen, 5 * P, "small") for _ in range(14)]  # 70 pages: 8.75 chunks raw
    with _arm_patch("memory_nowait"):
        stored = [store.offload(s, 1) for s in srcs]
    assert arena.pins >= len(srcs) * 5 * P // chunk  # pinned for the worst cases in flight
    with pytest.raises(Waited):  # the package's own rule is back
        for _ in range(8):
            store.offload(_data(gen, 5 * P, "small"), 1)
    monkeypatch.undo()
    store.wait_placed()
    for s, st in zip(srcs, stored):
        out = torch.full_like(s, POISON)
        store.restore(st, out)
        assert torch.equal(out, s)


@interpreter
def test_stores_now_says_whether_a_store_would_wait_for_slices_in_flight(gen, monkeypatch):
    """``PagedStore.stores_now(n)`` is false exactly where storing ``n`` bytes would make the
    host wait for slices in flight (their worst cases reach past the chunks held); nothing in
    flight, it is true (a chunk is pinned instead)."""
    chunk = 1 << 15
    store = _store(chunk=chunk, slice_bytes=1 << 13)
    arena = store.arena
    assert store.stores_now(8 * chunk)  # nothing in flight

    class Waited(Exception):
        pass

    # the pack stream behind: nothing is placed, and a wait stops
    def behind(through=None, why="caller"):
        if through is not None:
            raise Waited

    monkeypatch.setattr(arena, "confirm", behind)
    store.offload(_data(gen, 2 * P, "small"), 1)
    assert arena.pending
    room = (len(arena.backed) * chunk - arena.pending_upper) // P  # pages the held chunks take
    more = room + chunk // P * (len(arena.free) + 1)  # past them and every free chunk
    for pages, starts in ((room, True), (more, False)):
        assert store.stores_now(pages * P) is starts, (pages, room)
        try:
            arena.back(pages * P, None)
            waited = False
        except Waited:
            waited = True
        assert waited is not starts, (pages, room)
    monkeypatch.undo()
    assert store.stores_now(8 * chunk)  # placed: nothing in flight


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_stores_now_is_false_while_the_pack_stream_is_behind(gen):
    """On CUDA, with the pack stream held up by a sleeping kernel: a store that would need
    more chunks than are free is not started (``stores_now`` false) until the slice in flight
    is placed. Two stores first: the pack kernel is specialized on its slot parity (Triton
    specializes an integer argument equal to 1), slices take turns, and the second store's
    first launch loads the other variant, which waited out the sleep on an H200 (1.0 s for a
    1.0 s sleep, ``bench/results/h200_6c7a326_session45``; a warm store did not wait). The
    chunk holds every slice, so the store under test pins nothing."""
    store = _store("cuda", chunk=4 << 20, slice_bytes=1 << 20)
    src = _data(gen, 1 << 20, "bf16").cuda()
    producer = torch.cuda.current_stream()
    for _ in range(2):  # both parities' kernels loaded, chunk 0 pinned
        store.free(store.offload(src, 2, producer=producer))
    torch.cuda.synchronize()
    assert store.stores_now(8 << 20)  # nothing in flight
    with torch.cuda.stream(store.pack_stream):
        torch.cuda._sleep(500_000_000)  # ~0.25 s: the pack waits behind it
    stored = store.offload(src, 2, producer=producer)
    arena = store.arena
    assert len(arena.backed) == 1 and arena.pending, (arena.backed, arena.pending)
    assert store.stores_now(1 << 20)  # the chunk held has room for it
    assert not store.stores_now(8 << 20)  # it would wait for that slice
    store.pack_stream.synchronize()
    assert store.stores_now(8 << 20)
    out = torch.full_like(src, POISON)
    store.restore(stored, out)
    assert torch.equal(out, src)
    store.close()


def _all_come_back(store: PagedStore, srcs: list, stored: list) -> None:
    """Each of ``stored`` (a CPU store's) restored into a poisoned tensor equals its source."""
    for s, st in zip(srcs, stored):
        out = torch.full_like(s, POISON)
        store.restore(st, out)
        assert torch.equal(out, s)


def _offload_and_free(store: PagedStore, gen, n: int) -> None:
    """One step of a store's life: ``n`` small tensors stored, placed, then freed."""
    stored = [store.offload(_data(gen, 5 * P, "small"), 1) for _ in range(n)]
    store.poll()
    for st in stored:
        store.free(st)


@interpreter
def test_shrink_keeps_chunks_after_a_step_that_placed_nothing(gen):
    """A step that placed nothing here (it copied: ``prefer="speed"``'s trials) leaves the
    chunks for the next compressing step; smaller compressing steps let the extra go once
    the busy step has left the window."""
    from torch_pagecomp.offload import _arena

    store = _store(chunk=1 << 14, slice_bytes=1 << 13)
    arena = store.arena

    def step(n: int) -> None:
        _offload_and_free(store, gen, n)

    step(28)
    arena.shrink()
    held = arena.held_bytes
    assert held > 0
    arena.shrink()  # a step that copied instead: nothing placed since
    assert arena.held_bytes == held
    store.poll()  # the hooks poll (confirm) in a copied step too: still nothing placed
    arena.shrink()
    assert arena.held_bytes == held
    for _ in range(_arena.SHRINK_STEPS + 4):
        step(1)
        arena.shrink()
    assert arena.held_bytes < held


@interpreter
def test_shrink_lets_a_lone_big_step_go_and_keeps_the_window(gen):
    """A lone step that needed over ``SPIKE`` times any other step of the window (a first
    step, a gradient check) lets its extra chunks go at its own shrink; steps as big as one
    another (two big ones; a new sequence length each step) are all counted while in the
    window: no chunk is unpinned (an unpin waits for the whole GPU) while they alternate,
    and at most one more is pinned, once (the arena's end falls anywhere in a chunk)."""
    from torch_pagecomp.offload import _arena

    chunk = 1 << 14
    store = _store(chunk=chunk, slice_bytes=1 << 13)
    arena = store.arena

    def step(n: int) -> int:
        _offload_and_free(store, gen, n)
        arena.shrink()
        return arena.held_bytes

    big = step(40)  # two big first steps (a gradient check taken twice): kept while they
    assert step(40) >= big - chunk  # are in the window
    for _ in range(_arena.SHRINK_STEPS - 2):
        assert step(6) >= big - chunk
    usual = step(6)  # one left the window, the other is a lone spike: the extra goes
    assert usual <= big - 10 * chunk and arena.unpins >= 10
    for _ in range(_arena.SHRINK_STEPS):  # the big ones leave the window
        usual = step(6)
    unpins = arena.unpins
    assert step(40) <= usual + 4 * chunk  # a lone big step's extra goes at its own shrink
    assert arena.unpins >= unpins + 10
    step(14)
    pins, unpins = arena.pins, arena.unpins
    for n in (6, 14) * _arena.SHRINK_STEPS:
        step(n)
    assert arena.unpins == unpins and arena.pins <= pins + 1, (pins, unpins)
    assert arena.held_bytes <= 12 * chunk  # a busier step's 9, the headroom and one


@interpreter
def test_shrink_frees_the_chunks_backed_past_the_end_and_stores_still_round_trip(gen):
    """With nothing in flight, a shrink puts the chunks backed ahead of the arena's end (for
    the worst cases of slices since placed) on the free list and the limit back to the end's
    chunk; later stores back them again from there and come back exactly."""
    chunk = 1 << 14
    store = _store(chunk=chunk, slice_bytes=1 << 13)
    arena = store.arena
    for n in (40, 6):
        _offload_and_free(store, gen, n)
        arena.shrink()
        end = arena.frontier // chunk
        assert set(arena.backed) <= {end} and arena.limit <= (end + 1) * chunk
    pins = arena.pins
    srcs = [_data(gen, k * P + 7, "bf16") for k in (3, 9, 2)]
    stored = [store.offload(s, 2) for s in srcs]
    store.poll()
    for s, st in zip(srcs, stored):
        out = torch.full_like(s, POISON)
        store.restore(st, out)
        assert torch.equal(out, s)
    assert arena.pins == pins  # from the free list


@interpreter
def test_steps_of_varying_size_pin_their_chunks_once(gen, monkeypatch):
    """Steps of varying size reuse the chunks the first one pinned (pinning costs tens of
    milliseconds per chunk): a quieter step's shrink keeps them. At most one more is pinned,
    once: the first step starts at a chunk's start, and a later one anywhere in a chunk. A
    much quieter step lets the rest go."""
    from torch_pagecomp.offload import _arena

    chunk = 1 << 14
    store = _store(chunk=chunk, slice_bytes=1 << 13)
    arena = store.arena
    made = []
    real = _arena.HostMemory

    def counting(*args, **kwargs):
        made.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(_arena, "HostMemory", counting)

    def step(n: int) -> None:
        _offload_and_free(store, gen, n)
        arena.shrink()

    step(28)
    first = len(made)
    for n in (24, 28, 28):  # a quieter step, then busier ones again
        step(n)
    assert len(made) <= first + 1, (first, len(made))
    held = arena.held_bytes
    for _ in range(_arena.SHRINK_STEPS + held // chunk):  # much quieter steps: the rest go
        step(1)
    assert arena.held_bytes < held
    assert arena.held_bytes <= (3 + 2) * chunk  # their peak (<= 3 chunks) + headroom


@interpreter
def test_slices_across_the_table_window_wrap(gen, monkeypatch):
    """The chunk table is a window (chunk ``k`` at entry ``k % TABLE_SIZE``): with a table of 8
    entries the arena's end runs past it many times, and slices that cross a chunk boundary
    at the wrap (entry 7, then entry 0) come back exactly."""
    from torch_pagecomp.offload import _arena

    monkeypatch.setattr(_arena, "TABLE_SIZE", 8)
    chunk = 1 << 14
    store = _store(chunk=chunk, slice_bytes=1 << 13)
    assert store.arena.table.numel() == 8
    wrapped = 0
    for _ in range(14):
        srcs = [_data(gen, int(torch.randint(2 * P, 6 * P, (), generator=gen)), "bf16")
                for _ in range(4)]
        stored = [store.offload(s, 2) for s in srcs]
        store.poll()
        for s, st in zip(srcs, stored):
            wrapped += any(k % 8 == 7 and len(store.arena.chunks_of(sl.base, sl.total)) > 1
                           for sl in st.slices for k in [sl.base // chunk])
            out = torch.full_like(s, POISON)
            store.restore(st, out)
            assert torch.equal(out, s)
            store.free(st)
    assert store.arena.frontier > 2 * 8 * chunk  # around the window more than twice
    assert wrapped  # slices of odd compressed sizes cross chunk 7 -> 8 (entry 0) at a wrap


@interpreter
def test_release_idle_unpins_every_chunk_and_the_store_still_works(gen):
    """An offloader that settled on copying gives back every chunk once nothing is live or in
    flight, the ones backed ahead of the end included; the next tensor backs its chunks
    anew (the limit dropped with them) and comes back exactly."""
    chunk = 1 << 14
    store = _store(chunk=chunk, slice_bytes=1 << 13)
    arena = store.arena
    live = store.offload(_data(gen, 9 * P, "noise"), 1)
    gone = [store.offload(_data(gen, 5 * P, "small"), 1) for _ in range(3)]
    store.poll()
    for st in gone:
        store.free(st)
    arena.release_idle()  # one tensor still live: only the free chunks go
    assert arena.backed and not arena.free
    store.free(live)
    arena.release_idle()
    assert arena.held_bytes == 0 and arena.limit <= arena.frontier
    start = arena.frontier // chunk
    src = _data(gen, 7 * P + 5, "bf16")
    st = store.offload(src, 2)
    store.poll()
    assert min(arena.backed) == start  # backed again from the end's chunk
    assert all(k in arena.backed for sl in st.slices for k in arena.chunks_of(sl.base, sl.total))
    out = torch.full_like(src, POISON)
    store.restore(st, out)
    assert torch.equal(out, src)


@interpreter
def test_placement_descriptors_are_reused_in_order(gen, monkeypatch):
    """More slices in flight than pinned descriptors: a slot is reused only after the slice
    before it is confirmed, and every storage still comes back exact."""
    import torch_pagecomp.offload._arena as arena

    monkeypatch.setattr(arena, "DESC_SLOTS", 2)
    store = _store(slice_bytes=P)
    # (the arena made its descriptor ring of DESC_SLOTS = 2 rows)
    srcs = [_data(gen, 4 * P + 7, "bf16") for _ in range(3)]  # 12 slices of one page
    stored = [store.offload(s, 2) for s in srcs]
    assert len(store.arena.pending) <= 2
    store.poll()
    for s, st in zip(srcs, stored):
        out = torch.full_like(s, POISON)
        store.restore(st, out)
        assert torch.equal(out, s)
        assert all(sl.base is not None and sl.base >= 0 for sl in st.slices)


@interpreter
def test_free_before_placement_is_known(gen):
    """A storage dropped before its slices were confirmed is skipped when they are."""
    store = _store()
    a, b = _data(gen, 6 * P, "small"), _data(gen, 2 * P, "small")
    sa, sb = store.offload(a, 1), store.offload(b, 1)
    store.free(sa)  # nothing confirmed yet
    out = torch.empty_like(b)
    store.restore(sb, out)  # confirms both in order
    assert torch.equal(out, b)
    assert store.arena.used == sum(sl.total for sl in sb.slices)
    store.free(sb)
    assert store.arena.used == 0


def _packed(gen, n: int, end: int, limit: int, chunk: int, bufs: list, parity: int):
    """``n`` pages compressed and packed by ``pack_slice`` into host chunks ``bufs`` (the
    arena's end ``end`` in slot ``parity``; the other slot poisoned)."""
    pages = _data(gen, n * P, "noise").view(n, P)
    from torch_pagecomp import _ops

    payload, sizes, kinds = _ops.compress_eager(pages, 1)
    rel = torch.full((n,), -7, dtype=torch.int64)
    desc = torch.full((2,), -7, dtype=torch.int64)
    host_desc = torch.full((2,), -7, dtype=torch.int64)
    ends = torch.full((2,), -7, dtype=torch.int64)
    ends[parity] = end
    table = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    pack_slice(payload, sizes, rel, ends, parity, limit, desc, host_desc, table, chunk)
    return pages, payload, sizes, rel, desc, host_desc, ends, table


@interpreter
@pytest.mark.parametrize("parity", [0, 1])
def test_plan_refuses_past_the_backed_limit_and_pack_writes_nothing(gen, parity):
    chunk = 1 << 16
    buf = torch.full((chunk,), POISON, dtype=torch.uint8)  # one chunk backed
    *_, desc, host_desc, ends, _ = _packed(gen, 4, chunk - 2 * P, chunk, chunk, [buf], parity)
    assert desc.tolist() == host_desc.tolist()
    assert int(desc[0]) == -1 and int(ends[1 - parity]) == chunk - 2 * P  # nothing reserved
    assert int(ends[parity]) == chunk - 2 * P  # the slot read is left as it was
    assert bool((buf == POISON).all())


@interpreter
@pytest.mark.parametrize("parity", [0, 1])
@pytest.mark.parametrize("start", ["inside", "straddle", "boundary"])
def test_plan_places_at_the_end_and_pack_stays_inside_the_slice(gen, parity, start):
    """A slice goes at the arena's end, across a chunk boundary if it reaches one (a page may
    cross it: its two parts land in two chunks); the pack writes exactly the slice's padded
    pages and nothing around them; the new end goes to the other slot; the fetch kernel reads
    the same bytes back."""
    chunk = 1 << 16
    n = 5
    # noise pages are stored raw (P + header bytes): an odd number of words before the
    # boundary puts it inside a page
    end = {"inside": 16, "straddle": chunk - 3 * P + 48, "boundary": chunk}[start]
    bufs = [torch.full((chunk,), POISON, dtype=torch.uint8) for _ in range(3)]
    pages, payload, sizes, rel, desc, host_desc, ends, table = _packed(
        gen, n, end, 3 * chunk, chunk, bufs, parity)
    base, total = desc.tolist()
    assert host_desc.tolist() == [base, total]
    padded = (sizes.to(torch.int64) + ALIGN - 1) // ALIGN * ALIGN
    assert total == int(padded.sum()) and base == end  # placed at the end, wherever it is
    assert int(ends[1 - parity]) == base + total and int(ends[parity]) == end
    assert torch.equal(rel, torch.cumsum(padded, 0) - padded)
    arena = torch.cat(bufs)  # the three chunks as one byte range
    assert bool((arena[:base] == POISON).all()) and bool((arena[base + total:] == POISON).all())
    if start == "straddle":  # the boundary falls inside a page
        assert any(base + int(rel[i]) < chunk < base + int(rel[i]) + int(sizes[i])
                   for i in range(n))
    for i in range(n):
        at, size = base + int(rel[i]), int(sizes[i])
        assert torch.equal(arena[at:at + size], payload[i, :size])
    # and back: the fetch kernel reads exactly the slice, placed by the device descriptor
    back = torch.full((n * P + 64,), POISON, dtype=torch.uint8)
    fetch_from_host(back, desc, table, chunk)
    assert torch.equal(back[:total], arena[base:base + total])
    assert bool((back[total:] == POISON).all())
    desc_failed = torch.tensor([-1, total], dtype=torch.int64)
    fetch_from_host(back[total:], desc_failed, table, chunk)  # a failed slice reads nothing
    assert bool((back[total:] == POISON).all())


@interpreter
@pytest.mark.parametrize("where", ["behind", "crossing", "over the limit"])
def test_pack_writes_the_metadata_behind_the_pages_in_one_chunk(gen, where):
    """With a metadata buffer the pack reserves it behind the slice's pages and writes it
    there: the pages' offsets it planned, then the buffer's bytes from ``meta_from`` on (the
    sizes and kinds the compress wrote); where it would cross into the next chunk it starts
    that chunk instead (the bytes skipped stay as they were); ``total`` counts it all, and a
    slice whose metadata would pass the backed limit is refused, nothing written."""
    from torch_pagecomp import _ops
    from torch_pagecomp.offload._arena import _meta_offsets, _meta_views, meta_span

    chunk, n = 1 << 16, 3
    pages = _data(gen, n * P, "noise").view(n, P)  # stored raw: P + a header each
    payload, sizes, kinds = _ops.compress_eager(pages, 1)
    span = meta_span(n, False)
    meta = torch.full((span,), POISON, dtype=torch.uint8)
    _, _, sz, kd, _ = _meta_views(meta, n, False)
    sz.copy_(sizes)
    kd.copy_(kinds)
    padded = int(((sizes.to(torch.int64) + ALIGN - 1) // ALIGN * ALIGN).sum())
    # "crossing": the pages end 16 bytes before the boundary, the metadata does not fit there
    end = {"behind": 32, "crossing": chunk - padded - 16, "over the limit": 32}[where]
    limit = end + padded + span - 16 if where == "over the limit" else 2 * chunk
    bufs = [torch.full((chunk,), POISON, dtype=torch.uint8) for _ in range(2)]
    table = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    rel, desc, host_desc = (torch.full((k,), -7, dtype=torch.int64) for k in (n, 2, 2))
    ends = torch.tensor([end, -7], dtype=torch.int64)
    pack_slice(payload, sizes, rel, ends, 0, limit, desc, host_desc, table, chunk, meta,
               _meta_offsets(n, False)[1])
    arena = torch.cat(bufs)
    if where == "over the limit":
        assert desc.tolist() == [-1, padded + span] and int(ends[1]) == end
        assert bool((arena == POISON).all())
        return
    meta_at = end + padded if where == "behind" else chunk
    base, total = desc.tolist()
    assert base == end and total == meta_at + span - end and int(ends[1]) == base + total
    assert bool((arena[end + padded:meta_at] == POISON).all())  # skipped: not written
    got = _meta_views(arena[meta_at:meta_at + span].clone(), n, False)
    assert torch.equal(got[0], rel) and torch.equal(got[2], sizes) and torch.equal(got[3], kinds)
    assert bool((arena[:end] == POISON).all()) and bool((arena[base + total:] == POISON).all())


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("chunk, slice_bytes, mib",
                         [(64 << 20, 16 << 20, 40), (1 << 16, 1 << 14, 3)])
def test_gpu_round_trip_on_streams(gen, chunk, slice_bytes, mib):
    """Restored right after the offload (the placements mostly unknown: the fetch kernel reads
    the chunks); with 64 KiB chunks, slices and pages cross chunk boundaries on the GPU."""
    store = _store("cuda", chunk=chunk, slice_bytes=slice_bytes)
    srcs = [_data(gen, n, "bf16").cuda() for n in (mib << 20, (3 << 20) + 77, 5 * P)]
    stored = [store.offload(s, 2, producer=torch.cuda.current_stream()) for s in srcs]
    for s, st in zip(srcs, stored):
        assert torch.equal(_restored(store, st, s), s)
    torch.cuda.synchronize()
    assert store.failed_restores() == 0
    for st in stored:
        store.free(st)
    assert store.arena.used == 0


def test_parts_are_taken_only_where_the_store_reads_them_in_place(gen):
    """A list of parts (a batch's members) is read where it lies only by a GPU store without
    checksums; elsewhere, or with a part of partial pages, the call says so and stores
    nothing."""
    store = _store()
    assert not store.takes_parts
    parts = [(0, _data(gen, 2 * P, "bf16"))]
    with pytest.raises(ValueError, match="only on a GPU"):
        store.offload(parts, 2, float_format="bf16")
    assert store.arena.used == 0 and not store.arena.live
    if CUDA:
        gpu = _store("cuda")
        assert gpu.takes_parts and not _store("cuda", checksum=True).takes_parts
        with pytest.raises(ValueError, match="no parts"):
            gpu.offload([], 2, float_format="bf16")
        with pytest.raises(ValueError, match="whole pages"):
            gpu.offload([(0, _data(gen, P + 1, "bf16").cuda())], 2, float_format="bf16")
        odd = torch.empty(2 * P + 8, dtype=torch.uint8, device="cuda")[4:4 + 2 * P]
        with pytest.raises(ValueError, match="multiple of 8"):
            gpu.offload([(0, odd)], 2)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("codec", ["exp", "lz4-1", "lz4-2"])
@pytest.mark.parametrize("slice_bytes", [1 << 14, 16 << 20])
def test_gpu_parts_stored_where_they_lie_equal_their_join(gen, codec, slice_bytes):
    """A batch's members stored where they lie (a row table, no joined copy) give the pages
    their join gives, byte for byte on the host and back: members of 1-9 pages, separately
    allocated, across slices (16 KiB slices) or in one; the members are left as they were."""
    store = _store("cuda", chunk=64 << 20, slice_bytes=slice_bytes)
    ff, esize = (("bf16", 2) if codec == "exp" else (None, int(codec[-1])))
    kinds = ["bf16", "small", "noise"]
    parts, at = [], 0
    for i in range(7):
        pages = int(torch.randint(1, 10, (), generator=gen))
        part = _data(gen, pages * P, kinds[i % 3]).cuda()
        parts.append((at, part))
        at += part.numel()
    joined = torch.cat([t for _, t in parts])
    kept = joined.clone()
    producer = torch.cuda.current_stream()
    by_parts = store.offload(list(parts), esize, producer=producer, float_format=ff)
    by_join = store.offload(joined, esize, producer=producer, float_format=ff)
    torch.cuda.synchronize()
    store.poll()
    assert by_parts.nbytes == joined.numel() and len(by_parts.slices) == len(by_join.slices)
    assert by_parts.host_nbytes() == by_join.host_nbytes()
    for st in (by_parts, by_join):
        assert torch.equal(_restored(store, st, joined), kept)
    assert torch.equal(torch.cat([t for _, t in parts]), kept)
    assert store.failed_restores() == 0
    for st in (by_parts, by_join):
        store.free(st)
    assert store.arena.used == 0


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("batched, control", [(False, False), (True, False), (False, True)])
def test_gpu_arena_metadata_outlives_a_free_before_its_restore_ran(gen, batched, control):
    """A placed slice's metadata lies in the arena behind its pages, and a restore (one stored
    tensor's, or the hooks' batched ``restore_placed``) copies it up with them. Freed right
    after its restore was queued behind a sleeping restore stream, with its chunk then put on
    the free list and taken by new stores that overwrite it, the restore still decodes
    exactly: the chunk's reuse waits for the restore stream, for the metadata as for the
    pages. The control takes that wait away: the restore then reads the new stores' bytes."""
    if control and os.environ.get("PYTEST_XDIST_WORKER"):
        pytest.skip("the control's race needs the GPU to itself: beside other test processes "
                    "the new stores landed after the restore had read the slice intact "
                    "(bench/results/h200_session61, h200_session65)")
    from torch_pagecomp.offload._paged_group import restore_placed

    store = _store("cuda", chunk=4 << 20, slice_bytes=1 << 20)
    arena = store.arena
    prod = torch.cuda.current_stream()

    def fill(mib):  # bytes of no pattern, stored raw, with the kernels already compiled
        return store.offload(_data(gen, mib << 20, "noise").cuda(), 2, producer=prod)

    src = _data(gen, 2 << 20, "bf16").cuda()  # two slices, in chunk 0
    stored = store.offload(src, 2, producer=prod)
    warm = fill(1)  # compiles the kernels for raw pages before the race below
    store.wait_placed()
    chunk0 = arena.backed[0]
    for sl in stored.slices:  # the device buffer let go: the arena's copy, in one chunk
        assert not sl.meta.is_cuda and sl.base + sl.total <= arena.chunk
        assert sl.meta.data_ptr() == arena._address(sl.base + sl.meta_at)
        assert sl.meta_at + sl.meta.numel() == sl.total
    out = torch.full_like(src, POISON)
    rs = store.restore_stream
    rs.wait_stream(prod)  # after the poison
    with torch.cuda.stream(rs):
        torch.cuda._sleep(1_000_000_000)  # ~0.5 s: the restore runs after the stores below
        if batched:
            assert restore_placed(store, [stored], [out])
        else:
            store.restore(stored, out)
    store.free(stored)
    fillers = [fill(2) for _ in range(4)]  # the arena's end well past chunk 0
    store.wait_placed()
    for st in [warm] + fillers[:3]:  # nothing live in chunks 0-1 now: the free list
        store.free(st)
    assert arena.free and 0 not in arena.backed
    if control:
        arena.free = [(mem, None) for mem, _ in arena.free]
    # backed by the free chunks first: chunk 0's memory takes a later chunk, whose bytes
    # cover where the slice lay (a dry run of these steps on the CPU: 99.6% of them rewritten)
    late = [fill(2) for _ in range(4)]
    assert not arena.free and any(mem is chunk0 for mem in arena.backed.values())
    torch.cuda.synchronize()
    if control:  # the new stores' bytes were read instead of the slice's
        assert not torch.equal(out, src)
        store.statuses.failed()
    else:
        assert torch.equal(out, src)
        assert store.failed_restores() == 0
    for st in fillers[3:] + late:
        store.free(st)
    store.close()


@interpreter
@pytest.mark.parametrize("checksum", [False, True])
def test_placed_metadata_is_the_arena_copy_of_what_the_compress_wrote(gen, checksum):
    """Until a slice is placed its metadata is the buffer the compress wrote (and the pack
    its offsets); once placed it is the arena's copy at the end of the slice's bytes, equal
    part for part (the descriptor aside, which the pack does not copy), and the restores
    read it there."""
    from torch_pagecomp.offload._arena import DESC, _meta_views, meta_span

    store = _store(checksum=checksum)
    src = _data(gen, 9 * P + 5, "bf16")  # three slices and a tail
    stored = store.offload(src, 2)
    before = [sl.meta.clone() for sl in stored.slices]
    store.wait_placed()
    for sl, dev in zip(stored.slices, before):
        assert sl.meta.numel() == dev.numel() == meta_span(sl.n, checksum)
        assert sl.meta.data_ptr() == store.arena._address(sl.base + sl.meta_at)
        got, want = sl.parts(), _meta_views(dev, sl.n, checksum)
        for k, (a, b) in enumerate(zip(got, want)):
            if k != DESC and a is not None:
                assert torch.equal(a, b), k
    out = torch.full_like(src, POISON)
    store.restore(stored, out)
    assert torch.equal(out, src)


class _Failures:
    """A recording stand-in for ``RestoreFailures``: what was counted at once (``count_now``:
    the statuses' values), handed in (``add``: their sizes) and flushed."""

    def __init__(self, device=None):
        self.now, self.added, self.flushes, self.polls = [], [], 0, 0

    def count_now(self, statuses, stream):
        self.now.append((stream, statuses.tolist()))

    def add(self, statuses, stream):
        self.added.append((stream, [s.numel() for s in statuses]))

    def flush(self):
        self.flushes += 1

    def poll(self):
        self.polls += 1
        return 0


def _status_count(monkeypatch, pages: int):
    """A ``StatusCount`` of ``pages`` statuses on the CPU, with the stand-in failures and a
    stand-in ring stream (its ``ring_stream``)."""
    from torch_pagecomp.offload import _statuses

    monkeypatch.setattr(_statuses, "STATUS_PAGES", pages)
    monkeypatch.setattr(_statuses, "RestoreFailures", _Failures)
    monkeypatch.setattr(_statuses, "on_stream", lambda s: contextlib.nullcontext())
    return _statuses.StatusCount(torch.device("cpu"), object())


def test_the_restore_streams_statuses_take_a_ring_counted_when_it_fills(monkeypatch):
    """Restores on the ring's stream take consecutive parts of one buffer; a restore whose
    pages do not fit has the written part counted at once (its values, on that stream) and
    takes the ring from its start; ``failed`` counts what is written and polls. Another
    stream, or more pages than the ring holds, is not served. Run on the CPU with stand-ins."""
    sc = _status_count(monkeypatch, 10)
    ring, other = sc.ring_stream, object()
    assert sc.ring_bytes == 0  # made by the first restore on the ring's stream
    a = sc.take(4, ring)
    assert sc.ring_bytes == 10 * 4
    b = sc.take(5, ring)
    assert a.data_ptr() == sc._ring.data_ptr() and b.data_ptr() == a.data_ptr() + 4 * 4
    a.fill_(0)
    b.copy_(torch.tensor([0, 7, 0, 0, 3], dtype=torch.int32))
    assert sc.failures.now == []
    c = sc.take(2, ring)  # 9 + 2 > 10: the nine written are counted first
    assert sc.failures.now == [(ring, [0, 0, 0, 0, 0, 7, 0, 0, 3])]
    assert c.data_ptr() == sc._ring.data_ptr()
    assert sc.take(3, other) is None and sc.take(11, ring) is None
    c.fill_(0)
    assert sc.failed() == 0
    assert sc.failures.now[-1] == (ring, [0, 0]) and sc.failures.polls == 1
    assert sc.failed() == 0 and len(sc.failures.now) == 2  # nothing written: nothing counted


def test_statuses_of_other_streams_are_counted_once_a_bound_of_pages_is_held(monkeypatch):
    """Statuses a restore on another stream allocated are held per stream until
    ``STATUS_PAGES`` pages are held, then handed to the failure count and counted at once
    (freed after); ``failed`` hands what is left. Run on the CPU with stand-ins."""
    sc = _status_count(monkeypatch, 10)
    a, b = object(), object()
    for stream, n in ((a, 4), (b, 3), (a, 2)):
        sc.add(torch.zeros(n, dtype=torch.int32), stream)
    assert sc.failures.added == [] and sc._held_pages == 9
    sc.add(torch.zeros(1, dtype=torch.int32), b)  # 10: handed and counted
    assert sorted(sc.failures.added, key=lambda x: x[1]) == [(b, [3, 1]), (a, [4, 2])]
    assert sc.failures.flushes == 1 and sc._held_pages == 0 and not sc._held
    sc.add(torch.zeros(5, dtype=torch.int32), a)
    assert sc.failed() == 0
    assert sc.failures.added[-1] == (a, [5]) and sc.failures.polls == 1
    assert sc.failures.flushes == 1 and sc._held_pages == 0 and not sc._held


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("on_ring", [True, False])
def test_gpu_statuses_are_counted_once_a_bound_of_pages_is_held(gen, monkeypatch, on_ring):
    """Restores' decode statuses (4 bytes a page, on the GPU) are not held for a whole
    backward: on the store's restore stream they fill a ring of ``STATUS_PAGES`` counted
    whenever the next restore does not fit, on another stream they are held until as many
    pages are held. A page made undecodable (an unknown kind in its placed metadata) is
    counted once, by that count, before the backward's own (``failed_restores``), and the
    ring's reuse counts nothing more: every part is written before it is counted."""
    from torch_pagecomp.offload import _statuses
    from torch_pagecomp.offload._arena import KINDS, _meta_offsets

    monkeypatch.setattr(_statuses, "STATUS_PAGES", 8)
    store = _store("cuda", chunk=4 << 20, slice_bytes=1 << 20)
    srcs = [_data(gen, 3 * P, "small").cuda() for _ in range(5)]
    stored = [store.offload(s, 1, producer=torch.cuda.current_stream()) for s in srcs]
    store.wait_placed()
    sl = stored[1].slices[0]
    sl.meta[_meta_offsets(sl.n, False)[KINDS] + 1] = 0xEE  # page 1 of the second tensor
    stream = store.restore_stream if on_ring else torch.cuda.Stream()
    sc = store.statuses
    held = []
    with torch.cuda.stream(stream):
        for _ in range(3):  # the ring taken again and again
            for s, st in zip(srcs, stored):
                out = torch.full_like(s, POISON)
                store.restore(st, out)
                held.append(sc._at if on_ring else sc._held_pages)
                if st is not stored[1]:
                    assert torch.equal(out, s)
    # the ring counted whenever 3 more pages did not fit (each corrupt page then among the
    # counted: the last at the 13th restore); the held ones whenever 8 pages were held
    assert held == ([3, 6] * 7 + [3] if on_ring else [3, 6, 0] * 5)
    assert store.stats()["status_bytes"] == (8 * 4 if on_ring else 0)
    if on_ring:
        assert sc.failures.total() == 3
    sc.failed()  # what is held or in the ring, counted
    assert sc.failures.total() == 3 and store.failed_restores() == 3
    store.close()


@interpreter
@pytest.mark.parametrize("checksum", [True, False])
def test_checksums_catch_a_flipped_host_byte(gen, checksum):
    """A bit flipped in a stored RAW page (noise: its bytes decode 'fine' to the flipped ones):
    with checksums every restore path raises naming the failure; without, the wrong bytes come
    back (the control: the test sees what checksums are for)."""
    from torch_pagecomp.format import CorruptPageError
    from torch_pagecomp.offload._paged_group import StoredGroup

    store = _store(checksum=checksum)
    srcs = [_data(gen, 3 * P, "noise"), _data(gen, 2 * P, "small")]
    stored = [store.offload(s, 1) for s in srcs]
    store.wait_placed()
    sl = stored[0].slices[0]
    at = sl.base + int(torch.randint(0, P, (), generator=gen))
    host = store.arena.pieces(at, 1)[0][1]
    host[0] ^= 1 << int(torch.randint(0, 8, (), generator=gen))
    first = torch.empty_like(srcs[0])
    restores = [
        lambda: store.restore(stored[0], first),
        lambda: store.restore_group(StoredGroup(P, stored), torch.empty(5 * P, dtype=torch.uint8)),
        lambda: store.restore_group(StoredGroup(P, stored), [torch.empty_like(s) for s in srcs]),
    ]
    for restore in restores:
        if checksum:
            with pytest.raises(CorruptPageError, match="failed to decode"):
                restore()
        else:
            restore()  # silently wrong:
    if not checksum:
        assert (first != srcs[0]).sum() == 1
    out = torch.empty_like(srcs[1])
    store.restore(stored[1], out)  # the other tensor is intact either way
    assert torch.equal(out, srcs[1])


@pytest.mark.parametrize("device", ["cpu", pytest.param(
    "cuda", marks=pytest.mark.skipif(not CUDA, reason="needs CUDA"))])
@pytest.mark.parametrize("checksum", [True, False])
def test_checksums_cover_the_partial_last_page(gen, device, checksum):
    """A bit flipped in the plain-copied tail of a tensor (its last ``nbytes % P`` bytes):
    with checksums the single and the group restore both report it (raised on the CPU,
    counted on the GPU); without, the wrong byte comes back (the control)."""
    from torch_pagecomp.format import CorruptPageError
    from torch_pagecomp.offload._paged_group import StoredGroup

    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU stand-ins need the Triton interpreter")
    store = _store(device, checksum=checksum)
    # an odd first tail: the second tensor's pages start unaligned in the group's output
    tails = [int(torch.randint(1, P, (), generator=gen)) | 1 for _ in range(2)]
    srcs = [_data(gen, n * P + r, "small").to(device) for n, r in zip((2, 1), tails)]
    producer = torch.cuda.current_stream() if device == "cuda" else None
    stored = [store.offload(s, 1, producer=producer) for s in srcs]
    store.wait_placed()
    if device == "cuda":
        torch.cuda.synchronize()  # the tails are in host memory
    at = int(torch.randint(0, tails[0], (), generator=gen))
    stored[0].tail[at] ^= 1 << int(torch.randint(0, 8, (), generator=gen))
    first = torch.full_like(srcs[0], POISON)
    both = torch.full((sum(tails) + 3 * P,), POISON, dtype=torch.uint8, device=device)
    restores = [lambda: store.restore(stored[0], first),
                lambda: store.restore_group(StoredGroup(P, stored), both)]
    for restore in restores:
        if checksum and device == "cpu":
            with pytest.raises(CorruptPageError, match="failed to decode"):
                restore()
        else:
            restore()
    if device == "cuda":  # a poll reads the count of the poll before (it never blocks)
        store.failed_restores()
        torch.cuda.synchronize()
        assert store.failed_restores() == (2 if checksum else 0)
    if not checksum or device == "cuda":  # both restores ran to the end: one wrong byte each
        assert (first != srcs[0]).sum() == 1 and (both != torch.cat(srcs)).sum() == 1
    out = torch.empty_like(srcs[1])
    store.restore(stored[1], out)  # the other tensor's tail is intact
    assert torch.equal(out, srcs[1])


@interpreter
@pytest.mark.parametrize("checksum", [False, True])
def test_group_of_both_codecs(gen, checksum, monkeypatch):
    """A group mixing LZ4 and exponent-codec stored tensors (the hooks store a bf16 model's
    fp32 and bf16 activations side by side), interleaved: restored exact into one output per
    tensor, into one output, and with partial last pages (rows at any address), each run of
    one codec decoded by its own decoder over its slice of the metadata; a group extended
    after a restore reuses what it cached."""
    from torch_pagecomp import format as fmt
    from torch_pagecomp.offload import _decode
    from torch_pagecomp.offload._paged_group import StoredGroup, codec_runs

    calls = []
    for name in ("_decompress_rows", "_decompress_into"):
        real = getattr(_decode, name)
        monkeypatch.setattr(_decode, name, lambda *a, _real=real, _name=name, **k: (
            calls.append((_name, int(a[3].numel()), a[-1])), _real(*a, **k))[1])
    store = _store(checksum=checksum)
    spec = [(3, "bf16"), (2, "small"), (1, "bf16"), (2, "bf16"), (1, "noise"), (2, "bf16")]
    srcs = [_data(gen, n * P, kind) for n, kind in spec]
    stored = [store.offload(s, 2 if kind == "bf16" else 1,
                            float_format="bf16" if kind == "bf16" else None)
              for s, (_, kind) in zip(srcs, spec)]
    store.poll()
    assert [s.exp for s in stored] == [kind == "bf16" for _, kind in spec]
    exp_kinds = torch.cat([sl.kinds for s in stored if s.exp for sl in s.slices])
    assert ((exp_kinds & 15) == fmt.KIND_EXP).any()  # real EXP pages, not only RAW / FILL
    group = StoredGroup(P, stored[:4])
    assert codec_runs(group) == [(0, 1, 0, 3, True), (1, 2, 3, 5, False), (2, 4, 5, 8, True)]
    outs = [torch.full_like(s, POISON) for s in srcs[:4]]
    store.restore_group(group, outs)
    assert all(torch.equal(o, s) for o, s in zip(outs, srcs))
    rows = [c[1:] for c in calls if c[0] == "_decompress_rows"]  # (it decodes aside, here)
    assert rows == [(3, True), (2, False), (3, True)]
    for s in stored[4:]:
        group.append(s)  # after a restore: the first four's metadata is cached
    assert group.known == 4
    calls.clear()
    one = torch.full((group.nbytes,), POISON, dtype=torch.uint8)
    store.restore_group(group, one)
    assert torch.equal(one, torch.cat(srcs))
    assert calls == [("_decompress_into", n, exp) for n, exp in
                     ((3, True), (2, False), (3, True), (1, False), (2, True))]
    # partial last pages: later tensors' rows start anywhere in the one output
    tails = [int(torch.randint(1, P, (), generator=gen)) for _ in range(3)]
    ragged = [_data(gen, 2 * P + tails[0], "bf16"), _data(gen, P + tails[1], "small"),
              _data(gen, 2 * P + tails[2], "bf16")]
    rstored = [store.offload(s, 2, float_format=f) for s, f in zip(ragged, ("bf16", None, "bf16"))]
    out = torch.full((sum(s.numel() for s in ragged),), POISON, dtype=torch.uint8)
    store.restore_group(StoredGroup(P, rstored), out)
    assert torch.equal(out, torch.cat(ragged))
    for s in stored + rstored:
        store.free(s)
    assert store.arena.used == 0


def _checked_launches(launches: list, check=None):
    """A stand-in for ``launch.launch_known`` on the CPU: it makes the launch's tensors,
    asserts the classes and values it was given are theirs (and ``check(kernel, grid,
    args)``), notes the kernel in ``launches`` and runs it through the interpreter."""
    from torch_pagecomp.kernels import launch as L

    def run(kernel, grid, index, meta, classes, values, args, stream=None):
        args = args() if callable(args) else args
        assert classes == tuple(L._arg_class(a) for a in args)
        assert all(v == (a.data_ptr() if isinstance(a, torch.Tensor) else a)
                   for v, a in zip(values, args))
        if check is not None:
            check(kernel, grid, args)
        launches.append(kernel)
        L.launch(kernel, grid, torch.device("cpu"), args, meta, traced=False)

    return run


@interpreter
def test_placed_restore_by_address_launches_what_its_tensors_would(gen, monkeypatch):
    """The GPU's by-address batched restore, run on the CPU: its gather and decoders are given
    addresses into one work buffer and the upload ring (here: an uploaded table) and tensors
    only to compile; each launch's classes and values are those of the tensors it would make,
    and run with them (the interpreter), the restore is exact for both codecs."""
    from torch_pagecomp.kernels import lz4_decompress, row_table
    from torch_pagecomp.offload import _paged_group

    launches = []
    run = _checked_launches(launches)
    monkeypatch.setattr(row_table, "launch_known", run)
    monkeypatch.setattr(lz4_decompress, "launch_known", run)
    stream = object()  # any stream: the by-address path runs, its statuses are kept
    monkeypatch.setattr(_paged_group, "_launch_stream", lambda dev: stream)
    store = _store("cpu")
    store.statuses = _status_count(monkeypatch, 1 << 16)  # a GPU store's count, stand-ins
    spec = [(5, "bf16"), (3, "small"), (2, "bf16"), (6, "noise")]
    srcs = [_data(gen, n * P, kind) for n, kind in spec]
    stored = [store.offload(s, 2 if kind == "bf16" else 1,
                            float_format="bf16" if kind == "bf16" else None)
              for s, (_, kind) in zip(srcs, spec)]
    order = [3, 0, 2, 1]
    outs = [torch.full_like(srcs[i], POISON) for i in order]
    assert _paged_group.restore_placed(store, [stored[i] for i in order], outs)
    assert all(torch.equal(o, srcs[i]) for o, i in zip(outs, order))
    assert len(launches) == 4  # the gather, then LZ4's pair of decoders and the exponent one
    statuses = store.statuses._held.pop(stream)
    assert len(statuses) == 1 and not statuses[0].any()


@interpreter
def test_single_restore_by_address_launches_what_its_views_would(gen, monkeypatch):
    """``PagedStore.restore`` of placed slices by address (the GPU's path), run on the CPU:
    each decoder is given the addresses of the slice's staging, metadata, pages of the output
    and statuses, and the tensors only to compile; each launch's classes and values are those
    of the views it would cut, and run with them the restore is exact for both codecs, over
    several slices and a partial last page, into a poisoned output."""
    from torch_pagecomp.kernels import lz4_decompress
    from torch_pagecomp.offload import _paged

    launches = []

    def pages_out(kernel, grid, args):  # one program a page, into uint8 [n, P] pages
        assert grid == (args[4].shape[0],) and args[4].shape[1] == P

    monkeypatch.setattr(lz4_decompress, "launch_known", _checked_launches(launches, pages_out))
    monkeypatch.setattr(_paged, "_by_address", lambda out: True)
    store = _store("cpu")  # 4-page slices
    for kind, fmt in (("bf16", "bf16"), ("small", None)):
        src = _data(gen, 9 * P + 123, kind)
        stored = store.offload(src, 2 if fmt else 1, float_format=fmt)
        store.wait_placed()
        out = torch.full_like(src, POISON)
        launches.clear()
        status = store.restore(stored, out)
        assert torch.equal(out, src) and not status.any()
        assert len(launches) == 3 * (1 if fmt else 2)  # 3 slices: one decoder each, LZ4 two


@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=interpreter),
    pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="needs CUDA"))])
def test_placed_restore_of_both_codecs_in_arena_order(gen, monkeypatch, device):
    """The hooks' batched restore of placed slices (``restore_placed``): tensors of both codecs,
    several slices each over chunk boundaries, given in another order than stored, each decoded
    exact into its own poisoned output; one copy per run of adjacent arena bytes (not one per
    slice), one gather and one decode per codec."""
    from torch_pagecomp.kernels import row_table
    from torch_pagecomp.offload import _copies, _decode, _paged, _paged_group

    copies, gathers, decodes = [], [], []
    real_copy = _copies.copy_spans
    real_decode, real_at = _decode.decode_rows, _decode.decode_rows_at
    monkeypatch.setattr(_copies, "copy_spans",
                        lambda dst, spans: (copies.append(len(spans)), real_copy(dst, spans)))
    # the CPU's checked launchers take tensors; the GPU's launches take addresses
    real_gather, real_gather_at = row_table.gather_slice_meta, row_table.gather_slice_meta_at
    monkeypatch.setattr(row_table, "gather_slice_meta", lambda *a, **k: (
        gathers.append(a[0].shape[1]), real_gather(*a, **k)))
    monkeypatch.setattr(row_table, "gather_slice_meta_at", lambda *a: (
        gathers.append(a[1]), real_gather_at(*a)))
    monkeypatch.setattr(_decode, "decode_rows",
                        lambda *a: (decodes.append((a[1].numel(), a[-1])), real_decode(*a)))
    monkeypatch.setattr(_decode, "decode_rows_at",
                        lambda *a: (decodes.append((a[3], a[0])), real_at(*a)))
    store = _store(device)  # 4-page slices, 16-page chunks
    spec = [(9, "bf16"), (6, "small"), (1, "bf16"), (5, "noise"), (7, "bf16")]
    srcs = [_data(gen, n * P, kind).to(device) for n, kind in spec]
    producer = torch.cuda.current_stream() if device == "cuda" else None
    stored = [store.offload(s, 2 if kind == "bf16" else 1, producer=producer,
                            float_format="bf16" if kind == "bf16" else None)
              for s, (_, kind) in zip(srcs, spec)]
    store.wait_placed()  # on the GPU the packs run on; on the CPU they are done
    order = [4, 0, 2, 3, 1]  # the order a backward needs them in
    outs = [torch.full_like(srcs[i], POISON) for i in order]
    assert _paged_group.restore_placed(store, [stored[i] for i in order], outs)
    if device == "cuda":
        torch.cuda.synchronize()
        assert store.failed_restores() == 0
    assert all(torch.equal(o, srcs[i]) for o, i in zip(outs, order))
    n_slices = sum(len(s.slices) for s in stored)
    assert gathers == [n_slices]
    assert decodes == [(11, False), (17, True)]
    # stored one after another: adjacent in the arena, one run (a piece per chunk it spans)
    arena_bytes = sum(sl.total for s in stored for sl in s.slices)
    assert len(copies) == 1 and copies[0] <= arena_bytes // store.arena.chunk + 2
    # a slice that did not fit raises as a restore does; checksummed stores take the group path
    stored[2].slices[0].base = -1
    with pytest.raises(_paged.SliceNotStored):
        _paged_group.restore_placed(store, [stored[2]], [torch.empty_like(srcs[2])])
    assert not _paged_group.restore_placed(_store(device, checksum=True), stored[:1], outs[:1])


@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=interpreter),
    pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="needs CUDA"))])
def test_placed_restore_into_parts_decodes_only_their_pages(gen, monkeypatch, device):
    """``restore_placed`` into parts (the hooks' batch restored member by member): each part
    gets exactly its pages, across slice boundaries and codecs; pages no part holds (a member
    whose saved tensors are gone) are not decoded; a whole output beside them is unchanged."""
    from torch_pagecomp.offload import _decode, _paged_group

    decoded = []
    real_decode, real_at = _decode.decode_rows, _decode.decode_rows_at
    monkeypatch.setattr(_decode, "decode_rows",
                        lambda *a: (decoded.append(a[1].numel()), real_decode(*a)))
    monkeypatch.setattr(_decode, "decode_rows_at",
                        lambda *a: (decoded.append(a[3]), real_at(*a)))
    store = _store(device)  # 4-page slices
    spec = [(11, "bf16"), (6, "small"), (3, "noise")]
    srcs = [_data(gen, n * P, kind).to(device) for n, kind in spec]
    producer = torch.cuda.current_stream() if device == "cuda" else None
    stored = [store.offload(s, 2 if kind == "bf16" else 1, producer=producer,
                            float_format="bf16" if kind == "bf16" else None)
              for s, (_, kind) in zip(srcs, spec)]
    store.wait_placed()
    # members at pages [0, 2), [3, 10) of the first (one across two slice boundaries; pages 2
    # and 10 held by none), [1, 6) of the second, and the third whole
    cuts = [[(0, 2), (3, 10)], [(1, 6)]]
    parts = [[(a * P, torch.full(((b - a) * P,), POISON, dtype=torch.uint8, device=device))
              for a, b in c] for c in cuts]
    whole = torch.full_like(srcs[2], POISON)
    assert _paged_group.restore_placed(store, stored, [*parts, whole])
    if device == "cuda":
        torch.cuda.synchronize()
        assert store.failed_restores() == 0
    for src, ps in zip(srcs, parts):
        for base, buf in ps:
            assert torch.equal(buf, src[base:base + buf.numel()])
    assert torch.equal(whole, srcs[2])
    assert sum(decoded) == 2 + 7 + 5 + 3  # the parts' pages and the whole one's, no others
    assert _paged_group.restore_placed(store, stored[:1], [[]])  # no pages: nothing queued


def test_upload_ring_reuses_a_half_only_after_its_readers(monkeypatch):
    """The ring of small tables kernels read from page-locked memory (``UploadRing``): each
    table lands intact and 16-byte aligned; moving into a half first waits for the events taken
    after that half's readers when the writer left it, and for nothing else."""
    from torch_pagecomp.offload import _arena

    class Event:
        def __init__(self, stream):
            self.stream, self.waited = stream, False

        def synchronize(self):
            self.waited = True

    events = []
    monkeypatch.setattr(_arena, "mark", lambda s: events.append(Event(s)) or events[-1])
    ring = _arena.UploadRing(slots=32, pin=False)
    assert ring.put([[1, 2, 3]], "s0") is None  # not page-locked: callers upload instead
    ring.pin, ring.buf = True, torch.zeros(32, dtype=torch.int64)  # as page-locked, on the CPU
    ring.np = ring.buf.numpy()
    tables = []
    for k in range(40):
        rows = [[k, k + 1, k + 2], [7 * k, 0, -k], [1, 1, 1]][: 1 + k % 3]
        t = ring.put(rows, f"s{k % 2}")
        assert t.data_ptr() % 16 == 0 and t.shape == (len(rows), 3)
        tables.append((t, rows))
    for t, rows in tables[-3:]:  # the latest ones are still there (older ones reused)
        assert t.tolist() == rows
    assert events and all(e.stream in ("s0", "s1") for e in events)
    # every event but the latest lap's was waited for before its half was written again
    waited = [e.waited for e in events]
    assert any(waited) and not all(waited)
    assert ring.put([[0] * 17], "s0") is None  # more than half a ring


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="needs CUDA"))])
@pytest.mark.parametrize("driver", ["as found", "failing"])
def test_arena_spans_copy_by_address_exact_and_nowhere_else(gen, monkeypatch, device, driver):
    """``VirtualArena.spans`` of a range across chunk boundaries, copied by address
    (``_copies.copy_spans``: the driver's copy on CUDA) into a poisoned buffer at an offset:
    exactly those bytes, each where it belongs, nothing outside them; and back into the arena
    (``_copies.copy_to_host``, the sent slices' way) over poisoned chunks: those bytes only. A
    driver call that fails falls back to ``Tensor.copy_`` (for good) with the same result."""
    from torch_pagecomp.offload import _copies

    names = ("cuMemcpyHtoDAsync_v2", "cuMemcpyDtoHAsync_v2")
    calls = []
    if driver == "failing":  # as a thread without a current CUDA context would see it
        monkeypatch.setattr(_copies, "_DRIVER",
                            {n: (lambda *a: calls.append(a) or 201) for n in names})
    store = _store(device, chunk=1 << 13)
    arena = store.arena
    for k in range(3):  # three chunks of random bytes
        arena._back_chunk(k, None)
        arena.backed[k].tensor.copy_(torch.randint(0, 256, (arena.chunk,), generator=gen,
                                                   dtype=torch.uint8))
    whole = torch.cat([arena.backed[k].tensor for k in range(3)])
    base = int(torch.randint(1, arena.chunk, (1,), generator=gen))
    total = 2 * arena.chunk - int(torch.randint(0, arena.chunk // 2, (1,), generator=gen))
    spans = arena.spans(base, total, at=7)
    assert [n for _, _, n in spans] and sum(n for _, _, n in spans) == total
    assert len(spans) == len(arena.chunks_of(base, total))
    dst = torch.full((total + 16,), POISON, dtype=torch.uint8, device=device)
    _copies.copy_spans(dst, spans)
    got = dst.cpu()
    assert torch.equal(got[7:7 + total], whole[base:base + total])
    assert (got[:7] == POISON).all() and (got[7 + total:] == POISON).all()
    for k in range(3):
        arena.backed[k].tensor.fill_(POISON)
    src = torch.randint(0, 256, (total + 16,), generator=gen, dtype=torch.uint8).to(device)
    stream = torch.cuda.Stream() if device == "cuda" else None
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream())
    _copies.copy_to_host(src, spans, stream)
    if stream is not None:
        stream.synchronize()
    back = torch.cat([arena.backed[k].tensor for k in range(3)])
    assert torch.equal(back[base:base + total], src[7:7 + total].cpu())
    assert (back[:base] == POISON).all() and (back[base + total:] == POISON).all()
    if driver == "failing" and device == "cuda":
        assert len(calls) == 2 and all(_copies._DRIVER[n] is None for n in names)


@interpreter
@pytest.mark.parametrize("pages", [1, 4, 5, 9, 12])
def test_stores_now_asks_for_what_the_offload_backs(gen, monkeypatch, pages):
    """``stores_now`` (a due store starts only where the arena has room without waiting)
    asks the arena for what the offload then backs, slice by slice: each slice's worst case
    with its metadata behind its pages. Asked for the pages alone, it said there was room
    where backing then waited for slices in flight."""
    store = _store()  # slices of 4 pages
    backed = []
    back = store.arena.back
    monkeypatch.setattr(store.arena, "back",
                        lambda upper, s: backed.append(upper) or back(upper, s))
    nbytes = pages * P + int(torch.randint(0, P, (), generator=gen))
    asked = []
    room_now = store.arena.room_now
    monkeypatch.setattr(store.arena, "room_now",
                        lambda upper: asked.append(upper) or room_now(upper))
    assert store.stores_now(nbytes)
    stored = store.offload(_data(gen, nbytes, "noise"), 1)
    assert asked == [sum(backed)] and len(backed) == -(-pages // store.slice_pages)
    store.free(stored)


class _Copies:
    """A stand-in for the events after a sent slice's copies (``_arena.mark``): each not done
    until :meth:`finish` (the CPU's copies are done at once; only the host's view waits)."""

    def __init__(self):
        self.made = []

    def __call__(self, stream):
        event = _Copies.Event()
        self.made.append(event)
        return event

    def finish(self):
        for e in self.made:
            e.done = True

    class Event:
        done = False

        def query(self):
            return self.done

        def synchronize(self):
            self.done = True


@interpreter
def test_sent_slices_are_placed_once_their_copies_are_done(gen, monkeypatch):
    """The exponent codec's slices are sent (their copies into the arena queued once their
    placement is read) and only count as placed once those copies are done: until then a
    stored tensor is not ``stored()`` nor ``ready()``, a restore reads it by the kernel fetch
    (bit-exact), and one freed then keeps its chunks live until its copies are done; then it
    lets them go, and the one kept is placed, its metadata read from the arena, and restores
    bit-exact by the copy engine's path. ``settle`` waits for the copies."""
    from torch_pagecomp.offload import _arena

    copies = _Copies()
    monkeypatch.setattr(_arena, "mark", copies)
    store = _store(chunk=1 << 16, slice_bytes=3 * P)
    arena = store.arena
    srcs = [_data(gen, 7 * P + 5, "bf16"), _data(gen, 5 * P, "bf16")]
    stored = [store.offload(s, 2, float_format="bf16") for s in srcs]
    arena.confirm()
    slices = [sl for st in stored for sl in st.slices]
    assert len(slices) == 5 and len(arena.sending) == 5 and not arena.pending
    assert all(sl.base is None and sl.send is None for sl in slices)
    assert not any(st.stored() or st.ready() for st in stored)
    live = dict(arena.live)
    assert live and arena.used > 0
    for st, src in zip(stored, srcs):  # the fetch, from the device descriptors
        out = torch.full_like(src, POISON)
        store.restore(st, out)
        assert torch.equal(out, src)
    store.free(stored.pop(0))
    assert dict(arena.live) == live, "a slice's chunks went while its copies ran"
    copies.made[-1].done = True  # out of order: nothing placed before the first is done
    arena.confirm()
    assert len(arena.sending) == 5
    copies.finish()
    arena.confirm()
    assert not arena.sending
    kept = stored[0]
    assert kept.stored() and kept.ready()
    assert arena.used == sum(sl.total for sl in kept.slices)
    assert set(arena.live) == {k for sl in kept.slices for k in arena.chunks_of(sl.base,
                                                                                 sl.total)}
    for sl in kept.slices:  # the metadata read from the arena, behind the pages
        assert sl.meta.data_ptr() == arena._address(sl.base + sl.meta_at)
    out = torch.full_like(srcs[1], POISON)
    store.restore(kept, out)
    assert torch.equal(out, srcs[1])
    more = store.offload(_data(gen, 4 * P, "bf16"), 2, float_format="bf16")
    assert not more.stored()
    store.wait_placed()
    assert more.stored() and not arena.sending


@interpreter
def test_due_stores_wait_while_the_links_backlog_passes_its_bound(gen, monkeypatch):
    """``stores_now`` is false while the bytes on their way to host memory (sent slices whose
    copies are not seen done, slices not yet placed) pass ``BACKLOG_BYTES``, true again once
    those copies are done; below the bound the backlog holds nothing back."""
    from torch_pagecomp.offload import _arena, _paged

    copies = _Copies()
    monkeypatch.setattr(_arena, "mark", copies)
    store = _store(chunk=1 << 16, slice_bytes=3 * P)
    store.offload(_data(gen, 6 * P, "bf16"), 2, float_format="bf16")
    store.poll()
    backlog = store.arena.backlog()
    assert backlog == store.arena.sending_bytes > 0
    monkeypatch.setattr(_paged, "BACKLOG_BYTES", backlog)
    assert store.stores_now(P)
    monkeypatch.setattr(_paged, "BACKLOG_BYTES", backlog - 1)
    assert not store.stores_now(P)
    copies.finish()
    assert store.stores_now(P) and store.arena.backlog() == 0


@interpreter
def test_a_refused_store_names_its_reason(gen, monkeypatch):
    """``PagedStore.refusal`` says why a due store would wait, as the hooks count it: the
    payload while the last slice's plan has not finished (the GPU behind the host), the
    backlog while its copies are on their way past ``BACKLOG_BYTES``, the room while slices
    in flight speak for every chunk; None once the slice is in host memory."""
    from torch_pagecomp.offload import _arena, _paged

    plans, copies = _Copies(), _Copies()
    monkeypatch.setattr(_paged, "mark", plans)  # the plans (and hand-offs): not done
    monkeypatch.setattr(_arena, "mark", copies)
    chunk = 1 << 16
    store = _store(chunk=chunk, slice_bytes=3 * P)
    store.offload(_data(gen, 3 * P, "bf16"), 2, float_format="bf16")
    assert store.refusal(P) == "payload" and not store.stores_now(P)
    assert store.refusal(8 * chunk) == "room"  # past the chunk held and the free ones
    plans.finish()
    store.poll()  # placed: its copies into the arena queued, not done
    assert store.arena.sending_bytes > 0
    monkeypatch.setattr(_paged, "BACKLOG_BYTES", store.arena.backlog() - 1)
    assert store.refusal(P) == "backlog"
    copies.finish()
    store.poll()
    assert store.refusal(P) is None and store.stores_now(P)


@interpreter
@pytest.mark.parametrize("checksum", [False, True])
def test_a_restore_before_the_placement_is_read_decodes_the_payload_in_place(gen, monkeypatch,
                                                                           checksum):
    """A restore of an exponent-codec tensor whose last plan has not finished (its placement
    not read, the slice not sent) decodes that slice from the device payload its pages are
    still in, and the slices before it (sent when the next one took the payload, their copies
    not done) by the kernel fetch: bit-exact into a poisoned output, with no host wait (no
    plan event synchronised by the restore) and nothing sent by it; the slice then holds the
    event after that read, which the next slice into the same payload waits for. Once the
    plans and copies finish the slices are placed as usual, and restore from the arena
    bit-exact."""
    from torch_pagecomp.offload import _arena, _paged

    plans, copies = _Copies(), _Copies()
    monkeypatch.setattr(_paged, "mark", plans)  # the plans (and hand-offs): not done
    monkeypatch.setattr(_arena, "mark", copies)
    synced = []
    monkeypatch.setattr(_Copies.Event, "synchronize",
                        lambda self: synced.append(self) or setattr(self, "done", True))
    store = _store(chunk=1 << 16, slice_bytes=3 * P, checksum=checksum)
    arena = store.arena
    src = _data(gen, 7 * P + 5, "bf16")  # three slices and a tail
    stored = store.offload(src, 2, float_format="bf16")
    *sent, last = stored.slices
    assert len(sent) == 2 and last.send is not None and all(sl.send is None for sl in sent)
    before = (len(synced), len(arena.sending), len(arena.pending))
    assert before[1:] == (2, 1)
    out = torch.full_like(src, POISON)
    status = store.restore(stored, out)
    assert torch.equal(out, src) and bool((status == 0).all())
    assert (len(synced), len(arena.sending), len(arena.pending)) == before, \
        "the restore waited for a plan or sent a slice"
    assert last.send is not None and last.read in plans.made
    assert all(sl.read is None for sl in sent)
    # the payload is taken again: the next slice waits for the read (a device-side wait on
    # the GPU; here the host confirms the last slice first, as it must before reusing it)
    more = store.offload(_data(gen, 2 * P, "bf16"), 2, float_format="bf16")
    plans.finish()
    store.wait_placed()
    copies.finish()
    arena.confirm()
    assert all(sl.base is not None and sl.base >= 0 and sl.send is None
               for st in (stored, more) for sl in st.slices)
    out = torch.full_like(src, POISON)
    store.restore(stored, out)
    assert torch.equal(out, src)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("control", [False, True])
def test_gpu_a_restore_from_the_payload_is_read_before_the_next_slice_takes_it(gen, control):
    """A restore queued before its slice's plan finished decodes the device payload in place
    (``_Slice.read`` set); the next slice into that payload waits for that decode on the GPU:
    here the decode is held back behind a sleep on the restore stream well past the point
    where the next slice's compress could start, and both tensors still round-trip
    bit-exact. The control drops that wait (``read`` cleared): the second compress then
    overwrites the payload first and the first restore comes out wrong, so the test can see
    the race it guards against."""
    store = _store("cuda", chunk=1 << 22, slice_bytes=1 << 20)
    cur, rs = torch.cuda.current_stream(), store.restore_stream
    in_place = 0
    # a first round may find the plan finished (the host compiling or loading a kernel on its
    # way outlasts the sleep): the rounds after it run warm
    for _ in range(3):
        a, b = (_data(gen, 1 << 20, "bf16").cuda() for _ in range(2))
        torch.cuda._sleep(100_000_000)  # the compress of ``a`` waits behind it: plan pending
        st_a = store.offload(a, 2, producer=cur, float_format="bf16")
        out = torch.full_like(a, POISON)
        rs.wait_stream(cur)
        with torch.cuda.stream(rs):
            torch.cuda._sleep(400_000_000)
            store.restore(st_a, out)
        read = st_a.slices[0].read is not None
        in_place += read
        if control:
            st_a.slices[0].read = None
        st_b = store.offload(b, 2, producer=cur, float_format="bf16")  # the same payload
        cur.wait_stream(rs)
        assert torch.equal(out, a) != (control and read)
        assert torch.equal(_restored(store, st_b, b), b)
        torch.cuda.synchronize()
        store.free(st_a)
        store.free(st_b)
    assert in_place >= 2, "the plans finished before their restores"
    if not control:  # (the control's wrong reads may fail their pages' checks too)
        assert store.failed_restores() == 0


@interpreter
def test_random_sequences_keep_every_live_slice_in_backed_chunks(gen):
    """Random offloads (LZ4 bytes, bit-shuffled words, the exponent codec; partial last pages),
    restores (one by one, and batched as the hooks restore placed slices), frees, polls, idle
    releases and shrinks on one store, in a fresh order each run:
    after every step each live tensor's placed bytes lie in backed chunks whose addresses
    the kernels' table holds, no chunk is both backed and free, and the held bytes count
    exactly those chunks; every live tensor comes back exact whenever it is restored. On a
    GPU a chunk let go (unpinned) under a live slice is a kernel's or a copy's access to
    unregistered host memory: the bookkeeping is checked here, where a run is replayable
    from its seed."""
    chunk = 1 << 15
    store = _store(chunk=chunk, slice_bytes=1 << 13)
    arena = store.arena
    live: list[tuple[object, torch.Tensor]] = []

    def check() -> None:
        for stored, _ in live:
            for sl in stored.slices:
                if sl.base is not None and sl.base >= 0:
                    for k in arena.chunks_of(sl.base, sl.total):
                        assert k in arena.backed, (k, sl.base, sl.total, sorted(arena.backed))
        for k, mem in arena.backed.items():
            assert int(arena.table[k % arena.table.numel()]) == mem.addr, k
        backed_ids = {id(mem) for mem in arena.backed.values()}
        assert not backed_ids & {id(mem) for mem, _ in arena.free}
        assert arena.held_bytes == (len(arena.backed) + len(arena.free)) * chunk

    def restored(stored, src) -> torch.Tensor:
        out = torch.full_like(src, POISON)
        store.restore(stored, out)
        return out

    from torch_pagecomp.offload._paged_group import restore_placed

    ops = ("offload", "offload", "offload", "restore", "group", "free", "free", "poll", "idle",
           "shrink")
    for _ in range(40):
        op = ops[int(torch.randint(len(ops), (1,), generator=gen))]
        if op == "offload" or not live and op in ("restore", "group", "free"):
            pages = int(torch.randint(1, 12, (1,), generator=gen))
            tail = int(torch.randint(0, 2, (1,), generator=gen)) * 77
            kind = ("small", "bf16", "noise")[int(torch.randint(3, (1,), generator=gen))]
            src = _data(gen, pages * P + tail, kind)
            if kind == "bf16" and not tail and torch.randint(2, (1,), generator=gen):
                stored = store.offload(src, 2, float_format="bf16")
            else:
                stored = store.offload(src, 2 if kind == "bf16" else 1)
            live.append((stored, src))
        elif op == "restore":
            stored, src = live[int(torch.randint(len(live), (1,), generator=gen))]
            assert torch.equal(restored(stored, src), src)
        elif op == "group":  # the hooks' batched restore of whole-page tensors, any order
            whole = [x for x in live if x[1].numel() % P == 0]
            picks = torch.randperm(len(whole), generator=gen)[:3].tolist()
            outs = [torch.full_like(whole[i][1], POISON) for i in picks]
            if picks and restore_placed(store, [whole[i][0] for i in picks], outs):
                assert all(torch.equal(o, whole[i][1]) for o, i in zip(outs, picks))
        elif op == "free":
            stored, _ = live.pop(int(torch.randint(len(live), (1,), generator=gen)))
            store.free(stored)
        elif op == "poll":
            store.poll()
        elif op == "idle":
            store.release_idle()
        else:
            arena.shrink()
        check()
    store.poll()
    check()
    for stored, src in live:
        assert torch.equal(restored(stored, src), src)
        store.free(stored)
    store.release_idle()
    assert arena.held_bytes == 0


@interpreter
def test_the_second_per_slice_probe_keeps_no_second_payload(gen, monkeypatch):
    """``bench.dev_ab_steps``' ``memory_second_per_slice`` arm (session 82's experiment): a
    slice that takes the second payload gets a buffer of its own, which the slot does not
    keep; the package keeps it for the next. Every tensor comes back exactly."""
    from bench.dev_ab_steps import _arm_patch
    from torch_pagecomp.offload import _arena

    store = _store(slice_bytes=4 * P)
    monkeypatch.setattr(PagedStore, "_below_peak", lambda self, nbytes: True)
    first, second = store._slots
    srcs, stored = [], []

    def offload(pages):
        srcs.append(_data(gen, pages * P, "bf16"))
        stored.append(store.offload(srcs[-1], 2, float_format="bf16"))
        store.poll()
        return stored[-1].slices

    for arm, kept in (("memory_second_per_slice", False), ("memory", True)):
        with _arm_patch(arm):
            offload(2)  # the first
            with monkeypatch.context() as behind:  # the link behind: the second
                behind.setattr(_arena._Slice, "done", lambda sl: sl is not first.last)
                assert offload(3)[0] is second.last
            assert (second.buf is not None) == kept and first.buf is not None
    _all_come_back(store, srcs, stored)


@interpreter
def test_the_payload_grow_probe_keeps_a_larger_payload_for_a_smaller_slice(gen):
    """``bench.dev_ab_steps``' ``memory_payload_grow`` arm: a slice of less than half the
    first payload reuses it (the package makes it again at the slice's size); every tensor
    comes back exactly."""
    from bench.dev_ab_steps import _arm_patch

    store = _store(slice_bytes=4 * P)
    first = store._slots[0]
    srcs, stored = [], []
    for arm, pages in (("memory_payload_grow", 4), ("memory_payload_grow", 1), ("memory", 4),
                       ("memory", 1)):
        with _arm_patch(arm):
            srcs.append(_data(gen, pages * P, "bf16"))
            stored.append(store.offload(srcs[-1], 2, float_format="bf16"))
            store.poll()
        assert first.buf.numel() == (4 * P if arm == "memory_payload_grow" else pages * P)
    _all_come_back(store, srcs, stored)


@interpreter
def test_the_small_near_peak_probe_cuts_smaller_slices_only_near_the_peak(gen, monkeypatch):
    """``bench.dev_ab_steps``' ``memory_small_near_peak`` arm: where two full payloads would
    not fit under the last step's peak, a storage is cut into slices of
    ``NEAR_PEAK_SLICE_BYTES``; below it, into the store's own; worst-case room follows the
    same cut. Every tensor comes back exactly."""
    from bench import dev_ab_steps
    from bench.dev_ab_steps import _arm_patch

    monkeypatch.setattr(dev_ab_steps, "NEAR_PEAK_SLICE_BYTES", 2 * P)
    store = _store(slice_bytes=4 * P)
    under = [True]
    monkeypatch.setattr(PagedStore, "_below_peak", lambda self, nbytes: under[0])
    srcs, stored = [], []
    with _arm_patch("memory_small_near_peak"):
        for near in (False, True):
            under[0] = not near
            srcs.append(_data(gen, 8 * P + 5, "bf16"))
            assert store.worst_case(8 * P) == (4 if near else 2) * slice_upper(
                2 if near else 4, P, False)
            stored.append(store.offload(srcs[-1], 2, float_format="bf16"))
            store.poll()
            assert [sl.n for sl in stored[-1].slices] == ([2] * 4 if near else [4, 4])
    _all_come_back(store, srcs, stored)
