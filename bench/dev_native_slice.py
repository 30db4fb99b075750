"""Dev probe (#21, #26): a stored slice's GPU work queued by one native call, against the
activation store's Python path, in host microseconds a slice.

``python3 -m bench.dev_native_slice [--pages 16] [--slices 200] [--rounds 5]`` (GPU; a C
compiler, as the package's ``_native.c`` needs).

The hooks' compressed store spends 169-361 us of host time a slice on an H200's host. A plain
copy's store spends 31 us (``bench/results/h200_session62``). The part of a slice that is
always the same is six driver calls on two streams:
1. the compress stream waits for the last slice's event (its payload);
2. the placed exponent encoder runs;
3. an event is recorded;
4. the pack stream waits for that event;
5. the one-program plan (``place_slice``) runs;
6. an event is recorded.

The package queues them through ``launch.launch_known``, ``_events.mark`` and
``Stream.wait_event``, 75-100 us a slice measured piece by piece. Here a C function, built
from :data:`C_SOURCE` at run time, makes the six calls through the CUDA driver, taken by
``dlopen`` as ``offload._copies`` takes its copies.

Each kernel's parameters are read from the PTX entry of the kernel Triton compiled: an 8-byte
or 4-byte value for every argument Triton did not specialise away, then its scratch pointers
(passed 0; none of these kernels asks for scratch). The probe prints both paths' host us a
slice, median over ``--rounds``. It checks that the native path gives the same sizes, kinds,
arena end and last descriptor as the Python path, on the same pages. The encoder's page order
is not deterministic, so the payload is not compared.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time

C_SOURCE = r"""
#include <dlfcn.h>
#include <stdint.h>

typedef int (*launch_fn)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                         unsigned, void *, void **, void **);
typedef int (*record_fn)(void *, void *);
typedef int (*wait_fn)(void *, void *, unsigned);
static launch_fn cu_launch;
static record_fn cu_record;
static wait_fn cu_wait;

/* one kernel launch: its CUfunction, grid (x), threads a block, dynamic shared bytes, and
   its parameters, each read from an 8-byte slot (a 4-byte parameter from the slot's low
   half: little-endian hosts) */
typedef struct {
    void *fn;
    unsigned grid, threads, shared, nparams;
    uint64_t vals[24];
} pc_launch;

int pc_init(void) {
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) return -1;
    cu_launch = (launch_fn)dlsym(h, "cuLaunchKernel");
    cu_record = (record_fn)dlsym(h, "cuEventRecord");
    cu_wait = (wait_fn)dlsym(h, "cuStreamWaitEvent");
    return cu_launch && cu_record && cu_wait ? 0 : -2;
}

static int go(const pc_launch *l, void *stream) {
    void *kp[24];
    for (unsigned i = 0; i < l->nparams; i++) kp[i] = (void *)&l->vals[i];
    return cu_launch(l->fn, l->grid, 1, 1, l->threads, 1, 1, l->shared, stream, kp, 0);
}

/* a slice: the compress stream waits for last (if any), compresses, records handed; the
   pack stream waits for handed, plans, records stored. 0, or the first failing call's
   CUresult */
int pc_slice(const pc_launch *compress, const pc_launch *place, void *cs, void *ps,
             void *last, void *handed, void *stored) {
    int r;
    if (last && (r = cu_wait(cs, last, 0))) return r;
    if ((r = go(compress, cs))) return r;
    if ((r = cu_record(handed, cs))) return r;
    if ((r = cu_wait(ps, handed, 0))) return r;
    if ((r = go(place, ps))) return r;
    return cu_record(stored, ps);
}
"""


class Launch(ctypes.Structure):
    _fields_ = [("fn", ctypes.c_void_p), ("grid", ctypes.c_uint), ("threads", ctypes.c_uint),
                ("shared", ctypes.c_uint), ("nparams", ctypes.c_uint),
                ("vals", ctypes.c_uint64 * 24)]


def build(tmp: str) -> ctypes.CDLL:
    """The C helper, compiled into ``tmp`` and loaded (``pc_init`` done)."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler found (CC, cc or gcc)")
    src, lib = os.path.join(tmp, "pc_native.c"), os.path.join(tmp, "pc_native.so")
    with open(src, "w") as f:
        f.write(C_SOURCE)
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", lib, src, "-ldl"], check=True)
    dll = ctypes.CDLL(lib)
    dll.pc_slice.argtypes = [ctypes.POINTER(Launch)] * 2 + [ctypes.c_void_p] * 5
    dll.pc_slice.restype = ctypes.c_int
    return dll


_PARAM = re.compile(r"\.param\s+\.(?:u|s|b)(\d+)\b")


def ptx_params(ptx: str) -> list[int]:
    """Byte sizes of the parameters of the (one) ``.entry`` in ``ptx``."""
    head = ptx[ptx.index(".entry"):]
    head = head[:head.index(")")]
    return [int(bits) // 8 for bits in _PARAM.findall(head)]


def entry_launch(compiled, args: tuple, scratch: int) -> Launch:
    """A :class:`Launch` of Triton's ``compiled`` kernel for ``args`` (ints and addresses), its
    grid left to the caller: the PTX entry's parameters are ``args`` less the ints equal to 1
    where Triton specialised them away, then ``scratch`` pointers (passed 0). Raises where the
    entry does not match that, or where a parameter's size is not its argument's."""
    sizes = ptx_params(compiled.asm["ptx"])
    kept = list(args)
    if len(sizes) != len(kept) + scratch:
        kept = [a for a in args if a != 1]
    wants = [4 if -(1 << 31) <= a < (1 << 31) and not _is_addr(a) else 8
             for a in kept] + [8] * scratch
    md = compiled.metadata
    if (len(sizes) != len(kept) + scratch or sizes != wants
            or getattr(md, "launch_cooperative_grid", False) or getattr(md, "launch_pdl", False)
            or getattr(md, "num_ctas", 1) != 1):
        raise RuntimeError(f"PTX entry of params {sizes} does not match {len(args)} arguments "
                           f"and {scratch} scratch pointers (sizes wanted {wants})")
    lane = Launch(fn=compiled.function, grid=1, threads=32 * md.num_warps, shared=md.shared,
                  nparams=len(sizes))
    for i, v in enumerate(kept + [0] * scratch):
        lane.vals[i] = v & ((1 << 64) - 1)
    return lane


def _is_addr(a: int) -> bool:
    # the probe's addresses are device or page-locked host pointers: far above any int32
    return a >= 1 << 32


def measure(pages: int, slices: int, rounds: int) -> list[str]:
    import torch

    from torch_pagecomp._events import mark
    from torch_pagecomp.kernels.exp_codec import (
        _exp_encode_placed_kernel,
        _frozen_encode_meta,
        compress_exp_placed_at,
    )
    from torch_pagecomp.kernels.host_pack import _place_meta, _place_slice_kernel, place_slice_at
    from torch_pagecomp.kernels.launch import interpreting
    from torch_pagecomp.offload._arena import CHUNK_BYTES, meta_span

    if not torch.cuda.is_available():
        raise SystemExit("dev_native_slice: needs a CUDA device")
    dev, p = torch.device("cuda", torch.cuda.current_device()), 4096
    index = dev.index
    src = (torch.randn(pages * p // 2, device=dev) * 0.02).to(torch.bfloat16).view(torch.uint8)
    payload = torch.empty(pages * p, dtype=torch.uint8, device=dev)
    sizes = torch.empty(pages, dtype=torch.int32, device=dev)
    kinds = torch.empty(pages, dtype=torch.uint8, device=dev)
    rel = torch.empty(pages, dtype=torch.int64, device=dev)
    end = torch.zeros(1, dtype=torch.int64, device=dev)
    ends = torch.zeros(2, dtype=torch.int64, device=dev)
    desc = torch.zeros(2, dtype=torch.int64, device=dev)
    host_desc = torch.zeros(4, dtype=torch.int64, pin_memory=True)
    limit, mbytes = 1 << 50, meta_span(pages, False)
    cs, ps = torch.cuda.Stream(), torch.cuda.Stream()
    enc_addrs = (src.data_ptr(), payload.data_ptr(), sizes.data_ptr(), kinds.data_ptr(),
                 rel.data_ptr(), end.data_ptr())
    plan_addrs = (end.data_ptr(), ends.data_ptr(), desc.data_ptr(), host_desc.data_ptr())

    def reset():
        torch.cuda.synchronize()
        end.zero_()
        ends.zero_()
        torch.cuda.synchronize()

    def python_path():  # the GPU part of PagedStore._store_slice for a placed slice, on the
        last = None  # compress stream as the store's offload enters it (once, not per slice)
        with torch.cuda.stream(cs):
            for k in range(slices):
                if last is not None:
                    cs.wait_event(last)
                compress_exp_placed_at(index, pages, p, False, False, enc_addrs,
                                       lambda: (src.view(pages, p), payload, sizes, kinds, rel,
                                                end))
                handed = mark(cs)
                ps.wait_event(handed)
                place_slice_at(index, ps, plan_addrs, k & 1, limit, mbytes, CHUNK_BYTES,
                               lambda k=k: (end, ends, desc, host_desc, k & 1, limit, mbytes))
                last = mark(ps)

    # compile every specialisation the Python path launches, and keep Triton's kernels
    reset()
    with torch.cuda.stream(cs):
        enc = _exp_encode_placed_kernel[(pages,)](
            src.view(pages, p), payload, sizes, kinds, rel, end,
            **_frozen_encode_meta(p, False, interpreting()))
    plans = []
    for parity in (0, 1):
        with torch.cuda.stream(ps):
            plans.append(_place_slice_kernel[(1,)](end, ends, desc, host_desc, parity, limit,
                                                   mbytes, **_place_meta(CHUNK_BYTES)))
    reset()
    python_path()  # warm: the direct launch entries made
    reset()

    with tempfile.TemporaryDirectory() as tmp:
        dll = build(tmp)
        if dll.pc_init() != 0:
            raise SystemExit("dev_native_slice: libcuda.so.1 or its calls not found")
        # the encoder's arguments are all pointers (never specialised): the rest of its
        # entry's parameters are the scratch pointers this Triton adds to every kernel
        scratch = len(ptx_params(enc.asm["ptx"])) - len(enc_addrs)
        compress = entry_launch(enc, enc_addrs, scratch)
        compress.grid = pages
        place = [entry_launch(plans[par], (*plan_addrs, par, limit, mbytes), scratch)
                 for par in (0, 1)]
        events = [torch.cuda.Event() for _ in range(4)]  # recorded again and again (as mark)
        for ev in events:
            ev.record(cs)  # made: a raw handle exists once recorded
        raw = [ev.cuda_event for ev in events]
        craw, praw = cs.cuda_stream, ps.cuda_stream

        def native_path():
            last = None
            for k in range(slices):
                # what differs from slice to slice in the store (its pages, payload, metadata
                # and descriptor addresses, its pages' count) is written each time, as there
                vals, plan = compress.vals, place[k & 1]
                for i, a in enumerate(enc_addrs):
                    vals[i] = a
                compress.grid = pages
                for i, a in enumerate(plan_addrs):
                    plan.vals[i] = a
                handed, stored = raw[2 * (k & 1)], raw[2 * (k & 1) + 1]
                r = dll.pc_slice(ctypes.byref(compress), ctypes.byref(plan), craw, praw, last,
                                 handed, stored)
                if r:
                    raise RuntimeError(f"dev_native_slice: CUresult {r}")
                last = stored

        results, times = {}, {"python": [], "native": []}
        for r in range(rounds):
            for name, fn in (("python", python_path), ("native", native_path))[::1 - 2 * (r & 1)]:
                reset()
                t0 = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - t0) * 1e6 / slices)
                torch.cuda.synchronize()
                results[name] = (sizes.clone(), kinds.clone(), ends.clone(), host_desc[:3].clone())
        same = all(torch.equal(a, b) for a, b in zip(results["python"], results["native"]))
    lines = [f"## {slices} slices of {pages} pages (4 KiB, bf16), {rounds} rounds alternated, "
             f"on {torch.cuda.get_device_name(dev)}",
             "| path | host us a slice (median) | min-max |", "|---|---|---|"]
    for name, ts in times.items():
        lines.append(f"| {name} | {statistics.median(ts):.1f} | {min(ts):.1f}-{max(ts):.1f} |")
    lines.append(f"same sizes, kinds, arena end and last descriptor: {same} (arena end "
                 f"{int(results['native'][2].max())} bytes after {slices} slices)")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=16)
    ap.add_argument("--slices", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    print("\n".join(measure(a.pages, a.slices, a.rounds)), flush=True)


if __name__ == "__main__":
    main()
