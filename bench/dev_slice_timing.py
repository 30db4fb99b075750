"""Dev probe (#21, #26): where the host time of one slice's offload goes, piece by piece.

``python3 -m bench.dev_slice_timing [--kib 1024] [--calls 300]`` (GPU): ``PagedStore.offload``
of one bf16 tensor, ``--calls`` times (each stored tensor freed after the next one is stored,
the GPU synchronised every 16 calls), with ``perf_counter_ns`` marks between the steps of
``PagedStore._store_slice`` (a copy of its body with marks: keep the two in step when the store
changes); prints the median host us of each step and of the whole call, then the host us of a
few primitives on their own (an empty CUDA tensor, a view, an event's record, a stream wait,
``record_stream``, a direct Triton launch of the pack kernel's size).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch

from bench.corpora import build_corpus


def _timed_store_slice(store_mod, marks):
    """A copy of ``PagedStore._store_slice`` with a mark after each step."""
    from torch_pagecomp._events import mark
    from torch_pagecomp.kernels.host_pack import pack_slice_known
    from torch_pagecomp.offload._arena import _meta_bytes, _meta_views, _Slice, _wait
    from torch_pagecomp.offload._streams import on_stream

    def store_slice(self, src, first, n, element_size, float_format):
        clock = time.perf_counter_ns
        t = [clock()]
        p, cs, ps = self.page_size, self.compress_stream, self.pack_stream
        if len(self._packed) >= store_mod.SCRATCH_SLICES:
            _wait(cs, self._packed.popleft())
        t.append(clock())
        pages = (src.view(n, p) if first == 0 and src.numel() == n * p
                 else src[first * p:(first + n) * p].view(n, p))
        t.append(clock())
        payload = torch.empty((n, p), dtype=torch.uint8, device=src.device)
        t.append(clock())
        meta = torch.empty(_meta_bytes(n, self.checksum), dtype=torch.uint8, device=src.device)
        t.append(clock())
        rel, desc, sizes, kinds, sums = _meta_views(meta, n, self.checksum)
        t.append(clock())
        scratch = None if float_format else self._scratch(src, element_size)
        store_mod._compress(pages, element_size, (payload, sizes, kinds), scratch, float_format)
        t.append(clock())
        self.scratch_bytes = max(self.scratch_bytes,
                                 store_mod.SCRATCH_SLICES * n * p + self._scratch_held)
        self._handed = mark(cs)
        ps.wait_event(self._handed)
        t.append(clock())
        with on_stream(ps):
            host_desc = self.arena.host_desc()
            t.append(clock())
            self.arena.back(n * p, ps)
            t.append(clock())
            arena = self.arena
            pack_slice_known(payload, sizes, rel, arena.state, arena.parity, arena.limit, desc,
                             host_desc, arena.table, arena.chunk)
            t.append(clock())
            arena.parity ^= 1
            stored = mark(ps)
            t.append(clock())
            payload.record_stream(ps)
            meta.record_stream(ps)
            t.append(clock())
            self._packed.append(stored)
        sl = _Slice(first, n, sizes, kinds, rel, desc, host_desc, stored, sums, None)
        self.arena.add(sl, n * p)
        t.append(clock())
        names = ("wait scratch", "pages view", "payload empty", "meta empty", "meta views",
                 "compress launch", "hand-off", "on_stream + host_desc", "arena.back",
                 "pack launch", "mark", "record_stream x2", "slice + add")
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
    a = ap.parse_args()
    from torch_pagecomp.offload import _paged
    from torch_pagecomp.offload._paged import PagedStore

    dev = torch.device("cuda")
    marks: dict[str, list[float]] = collections.defaultdict(list)
    store = PagedStore(dev, 4096, tuple(torch.cuda.Stream(device=dev) for _ in range(3)))
    x = build_corpus("bf16-relu", a.kib << 10, 4096, dev, seed=1).reshape(-1)
    for fmt in ("bf16", None):
        marks.clear()
        whole = []
        original = PagedStore._store_slice
        PagedStore._store_slice = _timed_store_slice(_paged, marks)
        try:
            prev = None
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
        finally:
            PagedStore._store_slice = original
        print(f"== PagedStore.offload of {a.kib} KiB, {fmt or 'lz4'}: "
              f"{statistics.median(whole):.1f} us median host time per call")
        print("| step of _store_slice | median us |\n|---|---|")
        for name, v in marks.items():
            print(f"| {name} | {statistics.median(v[10:]):.1f} |")
    store.close()
    print("== primitives, median host us\n| call | us |\n|---|---|")
    print("\n".join(primitives(dev, a.calls)))


if __name__ == "__main__":
    main()
