"""Dev probe (#21, #26): where the host time of one slice's offload goes, piece by piece.

``python3 -m bench.dev_slice_timing [--kib 1024] [--calls 300] [--plain]`` (GPU):
``PagedStore.offload`` of one bf16 tensor, ``--calls`` times (each stored tensor freed after
the next one is stored, the GPU synchronised every 16 calls): the median host us of the call
as it is, then with ``perf_counter_ns`` marks between the steps of ``PagedStore._store_slice``
(a copy of its GPU path with marks: keep the two in step when the store changes) and each
step's median, then the host us of a few primitives on their own (an empty CUDA tensor, a
view, an event's record, a stream wait, ``record_stream``). The marked copy runs twice: as the
store is, and with the payload held until the compress stream has waited for its pack instead
of ``record_stream`` (an experiment for the payload's allocation cost). ``--plain``: the
unmarked call only, so the probe can time another tree's package (an A/B of the store's host
path)."""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch

from bench.corpora import build_corpus


def _timed_store_slice(store_mod, marks, hold: bool = False):
    """A copy of ``PagedStore._store_slice``'s GPU path with a mark after each step. ``hold``:
    the experiment of not calling ``record_stream`` on the payload (the allocator then records
    and polls an event per freed payload) and instead keeping it until the compress stream has
    waited for its pack, in the store's bounded queue of packs."""
    from torch_pagecomp._events import mark
    from torch_pagecomp.kernels.exp_codec import compress_exp_at
    from torch_pagecomp.kernels.host_pack import pack_slice_at
    from torch_pagecomp.kernels.lz4_compress import compress_at
    from torch_pagecomp.offload._arena import _meta_bytes, _meta_offsets, _Slice, _wait

    def store_slice(self, src, first, n, element_size, float_format):
        clock = time.perf_counter_ns
        t = [clock()]
        p, cs, ps, arena = self.page_size, self.compress_stream, self.pack_stream, self.arena
        if len(self._packed) >= store_mod.SCRATCH_SLICES:
            done = self._packed.popleft()  # with ``hold``: (event, payload), freed after this
            _wait(cs, done[0] if isinstance(done, tuple) else done)
            del done
        t.append(clock())
        payload = torch.empty((n, p), dtype=torch.uint8, device=src.device)
        t.append(clock())
        meta = torch.empty(_meta_bytes(n, self.checksum), dtype=torch.uint8, device=src.device)
        sl = _Slice(first, n, meta, self.checksum)
        t.append(clock())
        m = meta.data_ptr()
        rel, desc, sizes, kinds, _ = (m + o if o is not None else None
                                      for o in _meta_offsets(n, self.checksum))
        t.append(clock())
        if float_format:
            compress_exp_at(src.device.index, n, p, float_format == "fp16",
                            src.data_ptr() + first * p, payload.data_ptr(), sizes, kinds,
                            lambda: (store_mod._pages(src, first, n, p), payload, sl.sizes,
                                     sl.kinds))
        else:
            scratch = self._scratch(src, element_size)
            programs, meta_of = self._lz4_launch[element_size]
            compress_at(src.device.index, min(n, programs), n, meta_of[first * p % 8 == 0],
                        (src.data_ptr() + first * p, payload.data_ptr(), sizes, kinds,
                         scratch[0].data_ptr(), scratch[1].data_ptr()),
                        lambda: (store_mod._pages(src, first, n, p), payload, sl.sizes,
                                 sl.kinds, *scratch, n))
        t.append(clock())
        self.scratch_bytes = max(self.scratch_bytes,
                                 store_mod.SCRATCH_SLICES * n * p + self._scratch_held)
        self._handed = mark(cs)
        ps.wait_event(self._handed)
        t.append(clock())
        k = arena.host_desc()
        t.append(clock())
        arena.back(n * p, ps)
        parity, limit = arena.parity, arena.limit
        arena.parity ^= 1
        t.append(clock())
        pack_slice_at(src.device.index, ps, min(n, self._link_programs), n, p, arena.chunk,
                      (payload.data_ptr(), sizes, rel, arena.state.data_ptr(), desc,
                       arena.desc_addr(k), arena.table.data_ptr()), arena.table.numel(),
                      parity, limit, lambda: (payload, sl.sizes, sl.rel, arena.state, sl.desc,
                                              arena.descs[k], arena.table, n, parity, limit))
        t.append(clock())
        stored = mark(ps)
        t.append(clock())
        if not hold:
            payload.record_stream(ps)
        meta.record_stream(ps)
        t.append(clock())
        self._packed.append((stored, payload) if hold else stored)
        sl.host_desc, sl.stored = k, stored
        arena.add(sl, n * p)
        t.append(clock())
        names = ("wait scratch", "payload empty", "meta empty + slice", "meta addresses",
                 "compress launch", "hand-off", "host_desc", "arena.back", "pack launch",
                 "mark", "record_stream x2 (x1 held)", "add")
        for name, a, b in zip(names, t, t[1:]):
            marks[name].append((b - a) / 1e3)
        return sl

    return store_slice


def primitives(dev: torch.device, calls: int) -> list[str]:
    s = torch.cuda.Stream()
    x = torch.empty(1 << 20, dtype=torch.uint8, device=dev)
    ev = torch.cuda.Event()

    def us(fn) -> float:
        samples = []
        for i in range(calls):
            t0 = time.perf_counter_ns()
            fn()
            samples.append((time.perf_counter_ns() - t0) / 1e3)
            if i % 64 == 63:
                torch.cuda.synchronize()
        return statistics.median(samples)

    rows = {
        "torch.empty 1 MiB (cuda)": lambda: torch.empty(1 << 20, dtype=torch.uint8, device=dev),
        "slice + view": lambda: x[4096:8192].view(torch.int32),
        "new Event + record + drop": lambda: torch.cuda.Event().record(s),
        "stream.record_event()": lambda: s.record_event(),
        "kept Event.record": lambda: ev.record(s),
        "s.wait_stream(current)": lambda: s.wait_stream(torch.cuda.current_stream()),
        "record_stream": lambda: x.record_stream(s),
        "x.fill_(0) (a kernel)": lambda: x[:16].fill_(0),
    }
    return [f"| {name} | {us(fn):.1f} |" for name, fn in rows.items()]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kib", type=int, default=1024)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--plain", action="store_true",
                    help="only the call without marks (the probe given another tree's package)")
    a = ap.parse_args()
    from torch_pagecomp.offload import _paged
    from torch_pagecomp.offload._paged import PagedStore

    dev = torch.device("cuda")
    store = PagedStore(dev, 4096, tuple(torch.cuda.Stream(device=dev) for _ in range(3)))
    x = build_corpus("bf16-relu", a.kib << 10, 4096, dev, seed=1).reshape(-1)
    def offload_us(fmt) -> float:
        """The median host us of ``store.offload``, each stored tensor freed after the next."""
        whole, prev = [], None
        for i in range(a.calls + 10):
            cur = torch.cuda.current_stream()
            t0 = time.perf_counter_ns()
            stored = store.offload(x, 2, cur, float_format=fmt)
            if i >= 10:
                whole.append((time.perf_counter_ns() - t0) / 1e3)
            if prev is not None:
                store.free(prev)
            prev = stored
            store.poll()
            if i % 16 == 15:
                torch.cuda.synchronize()
        return statistics.median(whole)

    for fmt in ("bf16", None):
        plain = offload_us(fmt)
        if a.plain:
            print(f"== PagedStore.offload of {a.kib} KiB, {fmt or 'lz4'}: {plain:.1f} us "
                  "median host time per call")
            continue
        runs = {}  # hold -> (marked call us, marks)
        for hold in (False, True):
            marks = collections.defaultdict(list)
            original = PagedStore._store_slice
            PagedStore._store_slice = _timed_store_slice(_paged, marks, hold)
            try:
                runs[hold] = (offload_us(fmt), marks)
            finally:
                PagedStore._store_slice = original
                # the held payloads go (the store's own queue holds events only)
                store._packed = collections.deque(e[0] if isinstance(e, tuple) else e
                                                  for e in store._packed)
        print(f"== PagedStore.offload of {a.kib} KiB, {fmt or 'lz4'}: {plain:.1f} us median "
              f"host time per call ({runs[False][0]:.1f} with the marks, {runs[True][0]:.1f} "
              "with the payload held instead of record_stream)")
        print("| step of _store_slice | median us | payload held |\n|---|---|---|")
        for name, v in runs[False][1].items():
            print(f"| {name} | {statistics.median(v[10:]):.1f} | "
                  f"{statistics.median(runs[True][1][name][10:]):.1f} |")
    store.close()
    print("== primitives, median host us\n| call | us |\n|---|---|")
    print("\n".join(primitives(dev, a.calls)))


if __name__ == "__main__":
    main()
