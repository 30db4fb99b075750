"""Dev probe: where one small call's host time goes (issue #26).

``python3 -m bench.dev_call_profile [--kib 1024] [--calls 500] [--ops compress,decompress,
offload_restore]`` (GPU): cProfile's top functions over ``--calls`` calls each of
``torch_pagecomp.compress``, ``decompress(return_status=True)`` and ``PageCompressor.offload`` +
``restore`` + ``free`` on one bf16 tensor, GPU synchronised before each profile only (the calls
queue up, as a program's would).

``--timers``: instead of cProfile (which inflates small functions several times and charges a
full launch queue's wait to whichever call meets it), the API path's functions wrapped in
``perf_counter_ns`` timers (``bench.dev_hook_timing.instrument``: inclusive time, one clock
read on entry and exit), the GPU synchronised every 16 calls so the launch queue never fills;
per function its calls per op call and mean us per call; for ``offload_restore`` the
compressor's path down to the small store's launches (``OFFLOAD_TARGETS``). ``--device cpu``: the
same on the host path (a smoke run).
"""

from __future__ import annotations

import argparse

import torch

import torch_pagecomp as pc
from bench.corpora import build_corpus
from bench.dev_host_profile import profile_calls

# the public calls' path, caller first (inclusive times: a function's includes those it calls)
OP_TARGETS = (
    "torch_pagecomp.api:compress",
    "torch_pagecomp.api:decompress",
    "torch_pagecomp.api:_decode_direct",
    "torch_pagecomp.api:offsets_mismatch",
    "torch_pagecomp.format:check_compressed",
    "torch_pagecomp.format:as_pages",
    "torch_pagecomp.backend:route",
    "torch_pagecomp.backend:eager_call_ok",
    "torch_pagecomp.kernels.lz4_compress:compress_pages",
    "torch_pagecomp.kernels.lz4_decompress:decompress_into",
    "torch_pagecomp.kernels.launch:launch",
    "torch_pagecomp.kernels.launch:_launch_compiled",
    "torch_pagecomp.kernels.launch:launch_entry",
    "torch_pagecomp.kernels.launch:interpreting",
    "torch_pagecomp._ops:compress_cpu_direct",
    "torch_pagecomp._ops:decompress_cpu_direct",
)


# ``PageCompressor.offload`` + ``restore`` + ``free`` of a small 16-bit float tensor: the
# compressor, its kernel-only path and the small store (``offload._small_store``), #26
OFFLOAD_TARGETS = (
    "torch_pagecomp.module:PageCompressor.offload",
    "torch_pagecomp.module:PageCompressor.restore",
    "torch_pagecomp.module:PageCompressor._count",
    "torch_pagecomp.module:PageCompressor._float_format",
    "torch_pagecomp.module:PageCompressor._takes_direct",
    "torch_pagecomp.module:_check_offloadable",
    "torch_pagecomp.module:_not_capturing",
    "torch_pagecomp.handles:_bytes_of",
    "torch_pagecomp.handles:OffloadHandle.__init__",
    "torch_pagecomp.handles:RestoreFailures.add",
    "torch_pagecomp.pipeline:Pipeline.check_usable",
    "torch_pagecomp._direct:DirectPath.offload",
    "torch_pagecomp._direct:DirectPath.restore_into",
    "torch_pagecomp._direct:DirectPath.free",
    "torch_pagecomp._direct:DirectPath._drain",
    "torch_pagecomp._direct:DirectPath._bound",
    "torch_pagecomp._direct:DirectPath._settle",
    "torch_pagecomp._direct:DirectPath._current",
    "torch_pagecomp.offload._small_store:SmallStore.offload",
    "torch_pagecomp.offload._small_store:SmallStore.restore",
    "torch_pagecomp.offload._small_store:SmallStore.poll",
    "torch_pagecomp.offload._small_store:SmallStore.free",
    "torch_pagecomp.offload._small_store:SmallStore.settle",
    "torch_pagecomp.offload._small_store:SmallStore._scratch",
    "torch_pagecomp.offload._small_store:SmallStored.__init__",
    "torch_pagecomp.pools:HostArena.alloc",
    "torch_pagecomp.pools:HostArena.shrink",
    "torch_pagecomp.pools:HostArena.free",
    "torch_pagecomp._events:mark",
    "torch_pagecomp._events:handoff",
    "torch_pagecomp.offload._streams:current_stream",
    "torch_pagecomp.kernels.exp_codec:compress_exp_placed_at",
    "torch_pagecomp.kernels.exp_codec:decompress_exp_into_at",
    "torch_pagecomp.kernels.launch:launch_cached",
    "torch_pagecomp.kernels.launch:launch_known",
    "torch_pagecomp.kernels.launch:launch_entry",
)


def timed_calls(name: str, fn, calls: int, cuda: bool, targets=OP_TARGETS) -> str:
    """Per function of ``OP_TARGETS``: calls per call of ``fn`` and host us per call (mean),
    over ``calls`` calls of ``fn`` (the GPU synchronised every 16), beside ``fn``'s own."""
    import time

    from bench.dev_hook_timing import instrument, timer_stats

    for _ in range(20):
        fn()
    stats = timer_stats()
    undo = instrument(stats, targets)
    total = 0
    try:
        for i in range(calls):
            t0 = time.perf_counter_ns()
            fn()
            total += time.perf_counter_ns() - t0
            if cuda and i % 16 == 15:
                torch.cuda.synchronize()
    finally:
        for owner, attr, orig in reversed(undo):
            setattr(owner, attr, orig)
    lines = [f"## {name}: {total / calls / 1e3:.1f} us a call with the timers",
             "| function | calls a call | us a call (inclusive) |", "|---|---|---|"]
    for fname, each in sorted(stats.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"| {fname} | {len(each) / calls:.1f} | {sum(each) / len(each) / 1e3:.1f} |")
    return "\n".join(lines)


# untimed cycles first: more than RestoreFailures.HELD (32), so the failure count's first flush
# (its kernels' first launches: cat, count_nonzero, add) falls outside the profile; with 20,
# session 84's profile charged those first launches to the 63 flushes it timed
WARM = 80


def warm_cycle(comp, t: torch.Tensor, warm: int):
    """A function that offloads ``t`` through ``comp``, restores it and frees the handle, run
    ``warm`` times first (the GPU synchronised after)."""
    def cycle() -> None:
        h = comp.offload(t)
        comp.restore(h)
        h.free()

    for _ in range(warm):
        cycle()
    torch.cuda.synchronize()
    return cycle


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kib", type=int, default=1024)
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--ops", default="compress,decompress,offload_restore")
    ap.add_argument("--timers", action="store_true",
                    help="timers around the API path's functions instead of cProfile")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    ops = a.ops.split(",")
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    x = build_corpus("bf16-relu", a.kib << 10, 4096, dev, seed=1)
    c = pc.compress(x, element_size=2)
    pc.decompress(c, return_status=True)
    if cuda:
        torch.cuda.synchronize()
    if a.timers:
        calls = {"compress": lambda: pc.compress(x, element_size=2),
                 "decompress": lambda: pc.decompress(c, return_status=True)}
        for op in ops:
            if op in calls:
                print(timed_calls(op, calls[op], a.calls, cuda), flush=True)
        if "offload_restore" in ops:
            with pc.PageCompressor(device=dev) as comp:
                cycle = warm_cycle(comp, x.reshape(-1).view(torch.bfloat16), WARM)
                print(timed_calls("offload + restore + free", cycle, a.calls, cuda,
                                  OFFLOAD_TARGETS), flush=True)
        return
    pattern = "torch_pagecomp|triton_kernels|triton/runtime"
    if "compress" in ops:
        print("# compress", flush=True)
        print(profile_calls(lambda: pc.compress(x, element_size=2), a.calls, 25, pattern))
    if "decompress" in ops:
        print("# decompress(return_status=True)", flush=True)
        print(profile_calls(lambda: pc.decompress(c, return_status=True), a.calls, 25, pattern))
    if "offload_restore" in ops:
        comp = pc.PageCompressor()
        cycle = warm_cycle(comp, x.reshape(-1).view(torch.bfloat16), WARM)
        print("# PageCompressor.offload + restore + free", flush=True)
        print(profile_calls(cycle, a.calls, 30, pattern))
        comp.close()


if __name__ == "__main__":
    main()
