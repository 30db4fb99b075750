"""Dev probe: what one kernel launch and one event record cost the host here, layer by layer
(#21, #26).

``python3 -m bench.dev_launch_floor [--calls 200] [--rounds 15]`` (GPU). The activation store
issues two launches and three event records per saved tensor, and ``compress`` /
``decompress`` one or two launches per call; timed inside the hooks these came to 15-20 us a
launch and 8 us a record (``bench/results/h200_c070212_session40``). Measured alone here, the
driver's part was 4-5 us a launch and ~1 us a record, idle or busy, unless ~1,000 launches
were already queued (``bench/results/h200_967571b_session41``).

This prints the median host time per call (``perf_counter_ns`` over ``--calls`` back-to-back
calls, the median of ``--rounds``) of:

* a PyTorch kernel (``zero_`` of a small tensor) and a small ``torch.empty``;
* one small Triton kernel (7 arguments, the shape of the compress kernel's) launched through
  ``JITFunction.run``, the package's ``launch(traced=False)``, its cached ``launch_entry``, Triton's
  C launch function with every argument prepared, and the driver's ``cuLaunchKernel`` through
  ``ctypes`` (the kernel's parameters read from its PTX);
* an event record and a stream wait through ``torch.cuda`` and through the driver
  (``cuEventRecord`` / ``cuStreamWaitEvent`` on the same handles).

``--busy``: each round queued behind a long kernel on the same stream, as the hooks' calls
are during a training step.

The gap between the last two launch rows is what a native launch path could save per launch;
between the event rows, per record. Each row's kernel or record is checked to have run.
"""

from __future__ import annotations

import argparse
import ctypes
import re
import statistics

import torch
import triton
import triton.language as tl

from bench.timing import host_rounds_us


@triton.jit
def _touch(a_ptr, b_ptr, c_ptr, d_ptr, e_ptr, f_ptr, n, BLOCK: tl.constexpr):
    # program 0 adds one to a[0]: next to nothing to run, so the host cost is the launch's
    if tl.program_id(0) == 0:
        tl.store(a_ptr, tl.load(a_ptr) + 1)


_CTYPES = {"u64": ctypes.c_uint64, "b64": ctypes.c_uint64, "s64": ctypes.c_int64,
           "u32": ctypes.c_uint32, "b32": ctypes.c_uint32, "s32": ctypes.c_int32,
           "f32": ctypes.c_float, "u16": ctypes.c_uint16, "u8": ctypes.c_uint8}


def ptx_params(ptx: str, name: str) -> list[str]:
    """The PTX types of kernel ``name``'s parameters, in order."""
    m = re.search(r"\.entry\s+" + re.escape(name) + r"\s*\((.*?)\)", ptx, re.S)
    if m is None:
        raise RuntimeError(f"no .entry {name} in the PTX")
    return re.findall(r"\.param\s+\.(\w+)", m.group(1))


def driver_launcher(compiled, values: list[int], grid: int, stream: int):
    """A function that launches ``compiled`` with ``values`` (then zeros for the parameters
    Triton appends) through ``cuLaunchKernel``; raises if the driver refuses it."""
    cuda = ctypes.CDLL("libcuda.so.1")
    types = ptx_params(compiled.asm["ptx"], compiled.name)
    vals = list(values) + [0] * (len(types) - len(values))
    holders = [_CTYPES[t](v) for t, v in zip(types, vals)]
    params = (ctypes.c_void_p * len(holders))(*[ctypes.addressof(h) for h in holders])
    fn = cuda.cuLaunchKernel
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 6 + [ctypes.c_uint, ctypes.c_void_p,
                                                               ctypes.c_void_p, ctypes.c_void_p]
    threads = compiled.metadata.num_warps * 32
    shared = compiled.metadata.shared
    args = (compiled.function, grid, 1, 1, threads, 1, 1, shared, stream, params, None)

    def go() -> None:
        rc = fn(*args)
        if rc:
            raise RuntimeError(f"cuLaunchKernel returned {rc}")

    go.keep = (holders, params)  # alive as long as the function
    return go, types


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200,
                    help="calls per round: well under the ~1,000 launches that fill the queue "
                         "behind --busy's kernel (then every launch waits for it)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--busy", action="store_true",
                    help="time each round behind a long kernel on the same stream (the GPU busy, "
                         "every call queued, as in a training step) instead of on an idle GPU")
    a = ap.parse_args()
    from torch_pagecomp.kernels import launch as L

    dev = torch.device("cuda", torch.cuda.current_device())
    index = dev.index
    bufs = [torch.zeros(64, dtype=torch.int32, device=dev) for _ in range(6)]
    n = 1000
    args = (*bufs, n)
    meta = L.frozen_meta((("BLOCK", 128), ("num_warps", 4)))
    compiled = _touch[(1,)](*args, BLOCK=128, num_warps=4)
    L.launch(_touch, (1,), dev, args, meta, traced=False)  # fills the package's cache
    L.launch(_touch, (1,), dev, args, meta, traced=False)
    entries = [L._arg_entry(x) for x in args]
    key = (id(_touch), index, meta, tuple(e[0] for e in entries))
    entry = L._COMPILED.get(key)
    values = [e[1] for e in entries]
    stream = torch.cuda.current_stream(dev)
    raw = stream.cuda_stream
    rows: list[tuple[str, float, str]] = []

    def timed(name: str, fn, check: str = "") -> None:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        us = []
        for _ in range(a.rounds):
            if a.busy:  # ~0.1 s of GPU time queued first: longer than the round's calls
                torch.cuda._sleep(200_000_000)
            us += host_rounds_us(fn, a.calls, 1)
            torch.cuda.synchronize()
        rows.append((name, statistics.median(us), check))

    small = torch.zeros(16, device=dev)
    timed("torch: small.zero_()", small.zero_)
    timed("torch: torch.empty(256 B, cuda)",
          lambda: torch.empty(256, dtype=torch.uint8, device=dev))
    before = int(bufs[0][0])
    count = [0]

    def counted(fn):
        def go():
            fn()
            count[0] += 1
        return go

    timed("triton: kernel[grid](...) (JITFunction.run)",
          counted(lambda: _touch[(1,)](*args, BLOCK=128, num_warps=4)))
    timed("package: launch(traced=False)",
          counted(lambda: L.launch(_touch, (1,), dev, args, meta, traced=False)))
    if entry:
        timed("package: launch_entry (cached entry)",
              counted(lambda: L.launch_entry(entry, (1,), index, values)))
        _, fn, head, tail = entry
        prepared = (1, 1, 1, raw, *head, *values, *tail)
        timed("triton C launch, arguments prepared", counted(lambda: fn(*prepared)))
    else:
        rows.append(("package: launch_entry", float("nan"), "no direct entry on this Triton"))
    ptrs = [b.data_ptr() for b in bufs]
    try:
        go, types = driver_launcher(compiled, [*ptrs, n], 1, raw)
        timed("driver: cuLaunchKernel via ctypes", counted(go), " ".join(types))
    except (OSError, RuntimeError, AttributeError, KeyError) as exc:
        rows.append(("driver: cuLaunchKernel via ctypes", float("nan"), repr(exc)[:80]))
    torch.cuda.synchronize()
    ran = int(bufs[0][0]) - before
    launches = f"kernels ran {ran} of {count[0]} launched"

    side = torch.cuda.Stream(dev)
    ev = torch.cuda.Event()
    ev.record(stream)
    timed("torch: event.record(stream) (kept event)", lambda: ev.record(stream))
    timed("torch: stream.wait_event(event)", lambda: side.wait_event(ev))
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        rec, wait = cuda.cuEventRecord, cuda.cuStreamWaitEvent
        rec.restype = wait.restype = ctypes.c_int
        rec.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        wait.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
        h_ev, h_side = ev.cuda_event, side.cuda_stream

        def drec():
            if rec(h_ev, raw):
                raise RuntimeError("cuEventRecord failed")

        def dwait():
            if wait(h_side, h_ev, 0):
                raise RuntimeError("cuStreamWaitEvent failed")

        timed("driver: cuEventRecord via ctypes", drec)
        timed("driver: cuStreamWaitEvent via ctypes", dwait)
        small.fill_(3)
        drec()
        ev.synchronize()
        ok = bool((small == 3).all())
        rows.append(("(the driver's record is the event torch waits on)", float("nan"),
                     "ok" if ok else "MISMATCH"))
    except (OSError, RuntimeError, AttributeError) as exc:
        rows.append(("driver: events via ctypes", float("nan"), repr(exc)[:80]))
    torch.cuda.synchronize()
    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}, triton "
          f"{triton.__version__}; {a.calls} calls x {a.rounds} rounds, GPU "
          f"{'busy (each round behind a long kernel)' if a.busy else 'idle'}; {launches}")
    print("| call | host us | note |\n|---|---|---|")
    for name, us, note in rows:
        print(f"| {name} | {us:.2f} | {note} |")


if __name__ == "__main__":
    main()
