"""Dev probe: does one host core run the hooks' kind of work faster than another? (#21)

The stock bench's processes differ by 15-30% in host issue time on one host with the same code
(``speed`` copying against ``uncompressed``, the same variant in two rounds:
bench/results/h200_d04bdbf_session34). This times, in fresh processes, each pinned to one core
(``os.sched_setaffinity``) and then several unpinned ones, two loops:

* ``py``: the interpreter alone (a loop of small Python work);
* ``cuda``: the primitives the hooks issue per saved tensor, host time only: a CUDA
  ``torch.empty``, a side-stream switch, an event record and wait, a view, a copy into page-locked
  memory (the GPU keeps up: each copy is 4 KiB).

Per process: us per iteration of each (median of rounds), the core it ran on, whether the
GPU's PCI device lists that core as local, and its hyperthread siblings. If pinned cores differ
as much as unpinned processes do, a process's core explains the spread, and the bench can pin.

    python3 -m bench.dev_core_speed [--cores all|0,3,..] [--unpinned 6] [--iters 2000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys


def _read(path: str) -> str | None:
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return None


def _cpulist(text: str | None) -> set[int]:
    """``0-3,8`` as a set of ints (empty for None)."""
    out: set[int] = set()
    for part in (text or "").split(","):
        if "-" in part:
            a, b = part.split("-")
            out.update(range(int(a), int(b) + 1))
        elif part.strip():
            out.add(int(part))
    return out


def gpu_local_cores() -> set[int]:
    """Cores the GPU's PCI device lists as local (empty where unknown)."""
    import torch

    p = torch.cuda.get_device_properties(0)
    try:
        bus = f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
    except AttributeError:
        return set()
    return _cpulist(_read(f"/sys/bus/pci/devices/{bus}/local_cpulist"))


def child(core: int | None, iters: int, rounds: int) -> dict:
    if core is not None:
        os.sched_setaffinity(0, {core})
    import torch

    from bench.timing import host_rounds_us

    dev = torch.device("cuda")
    side = torch.cuda.Stream()
    host = torch.empty(4096, dtype=torch.uint8, pin_memory=True)

    def py_loop() -> None:
        acc = 0
        for i in range(200):
            acc += (i * i) % 7
        d = {"a": acc}
        d["b"] = d.get("a", 0) + 1

    def cuda_loop() -> None:
        x = torch.empty(1 << 20, dtype=torch.uint8, device=dev)
        ev = torch.cuda.Event()
        ev.record()
        with torch.cuda.stream(side):
            side.wait_event(ev)
            host.copy_(x[:4096], non_blocking=True)
            x.record_stream(side)

    out = {"core": core}
    for name, fn in (("py", py_loop), ("cuda", cuda_loop)):
        for _ in range(iters // 4):  # warm-up
            fn()
        torch.cuda.synchronize()
        per = host_rounds_us(fn, iters, rounds, after=torch.cuda.synchronize)
        out[f"{name}_us"] = statistics.median(per)
        out[f"{name}_spread"] = (max(per) - min(per)) / statistics.median(per)
    out["ran_on"] = sorted(os.sched_getaffinity(0)) if core is not None else None
    out["last_cpu"] = int(_read("/proc/self/stat").rsplit(")", 1)[1].split()[36])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cores", default="all", help="cores to pin a process to, one each")
    ap.add_argument("--unpinned", type=int, default=6, help="unpinned processes after them")
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is not None:
        core = None if args.child == "none" else int(args.child)
        print(json.dumps(child(core, args.iters, args.rounds)))
        return 0
    import torch

    allowed = sorted(os.sched_getaffinity(0))
    cores = allowed if args.cores == "all" else [int(c) for c in args.cores.split(",")]
    local = gpu_local_cores()
    print(f"# {torch.cuda.get_device_name()}, {len(allowed)} cores allowed; GPU-local cores: "
          f"{sorted(local) or 'unknown'}")
    print("| process | core | siblings | GPU-local | py us | cuda us | spread py / cuda |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for k, core in enumerate([*cores, *([None] * args.unpinned)]):
        cmd = [sys.executable, "-m", "bench.dev_core_speed", "--child",
               "none" if core is None else str(core), "--iters", str(args.iters),
               "--rounds", str(args.rounds)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if r.returncode:
            print(f"| {k} | {core} | failed: {r.stderr.strip()[-300:]} |")
            continue
        row = json.loads(r.stdout.strip().splitlines()[-1])
        rows.append(row)
        c = core if core is not None else row["last_cpu"]
        sib = _read(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list")
        pinned = "pinned" if core is not None else "unpinned (last on)"
        print(f"| {k} {pinned} | {c} | {sib} | {c in local if local else '?'} | "
              f"{row['py_us']:.2f} | {row['cuda_us']:.2f} | "
              f"{row['py_spread']:.2f} / {row['cuda_spread']:.2f} |", flush=True)
    for label, sel in (("pinned", [r for r in rows if r["core"] is not None]),
                       ("unpinned", [r for r in rows if r["core"] is None])):
        if sel:
            for key in ("py_us", "cuda_us"):
                v = [r[key] for r in sel]
                print(f"# {label} {key}: min {min(v):.2f} median {statistics.median(v):.2f} "
                      f"max {max(v):.2f} (max/min {max(v) / min(v):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
