"""Dev probe: line by line, where the hooks' compressed store and restore spend host time (#21).

``python3 -m bench.dev_line_profile --models bert-1024 --variant memory --steps 4`` (GPU; needs
``line_profiler``, a dev tool carried as a wheel, never a dependency): a few warm steps of a
stock model under ``variant``'s hooks, then ``--steps`` steps with ``line_profiler`` on the
functions in ``--functions`` (``module:qualname``; by default the batched restore, the
statuses' count and the slice store). Prints each function's lines with hits and host us per
hit. Line tracing inflates every line by about the same fixed cost, so compare lines with
each other, not with ``bench.dev_hook_timing``'s totals.

``--cycle KIB``: instead of a model, ``--steps`` cycles of ``PageCompressor.offload`` +
``restore`` + ``free`` of one bf16 tensor of ``KIB`` KiB (#26; the GPU synchronised every 16
cycles, as ``bench.dev_call_profile --timers`` does), with ``CYCLE`` as the default functions.
"""

from __future__ import annotations

import argparse
import importlib
import io
import time

DEFAULT = (
    "torch_pagecomp.offload._paged_group:restore_placed",
    "torch_pagecomp.offload._paged_group:_gather_and_decode_at",
    "torch_pagecomp.offload._paged:PagedStore._count_failures",
    "torch_pagecomp.handles:RestoreFailures.add",
    "torch_pagecomp.handles:RestoreFailures._count",
    "torch_pagecomp.offload._paged:PagedStore.offload",
    "torch_pagecomp.offload._paged:PagedStore._store_slice",
    "torch_pagecomp.offload._paged:PagedStore.free",
    "torch_pagecomp.offload._backward:Backward.restore",
    "torch_pagecomp.offload._backward:Backward.restore_batch",
)

# one small tensor's round trip through PageCompressor's kernel-only store (#26)
CYCLE = (
    "torch_pagecomp.module:PageCompressor.offload",
    "torch_pagecomp.module:PageCompressor.restore",
    "torch_pagecomp._direct:DirectPath.offload",
    "torch_pagecomp._direct:DirectPath.restore_into",
    "torch_pagecomp._direct:DirectPath.free",
    "torch_pagecomp._direct:DirectPath._drain",
    "torch_pagecomp.offload._paged:PagedStore.offload",
    "torch_pagecomp.offload._paged:PagedStore._store_slice",
    "torch_pagecomp.offload._paged:PagedStore.restore",
    "torch_pagecomp.offload._paged:PagedStore.free_after_restores",
    "torch_pagecomp.offload._paged:PagedStore.free",
    "torch_pagecomp.offload._arena:VirtualArena.back",
    "torch_pagecomp.offload._arena:VirtualArena.confirm",
    "torch_pagecomp.offload._arena:VirtualArena.release",
    "torch_pagecomp.handles:RestoreFailures.add",
)


def _function(target: str):
    mod_name, qual = target.split(":")
    obj = importlib.import_module(mod_name)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


def main() -> None:
    import torch
    from line_profiler import LineProfiler

    from bench.dev_hook_timing import training_step

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="bert-1024")
    ap.add_argument("--variant", default="memory")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--functions", default=None)
    ap.add_argument("--cycle", type=int, default=0, help="KiB: the offload cycle, not a model")
    a = ap.parse_args()
    if a.cycle:
        _cycle(a)
        return
    for name in a.models.split(","):
        step, off = training_step(name, a.variant)
        for _ in range(a.warmup):
            step()
        torch.cuda.synchronize()
        prof = LineProfiler()
        for target in (a.functions or ",".join(DEFAULT)).split(","):
            prof.add_function(_function(target))
        t0 = time.perf_counter()
        prof.enable_by_count()
        for _ in range(a.steps):
            step()
        torch.cuda.synchronize()
        prof.disable_by_count()
        ms = (time.perf_counter() - t0) * 1e3 / a.steps
        out = io.StringIO()
        prof.print_stats(stream=out, output_unit=1e-6, stripzeros=True)
        print(f"## {name} {a.variant}: {a.steps} steps, {ms:.1f} ms a step profiled")
        print(out.getvalue(), flush=True)
        off.remove()


def _cycle(a) -> None:
    """``--cycle``: the small tensor's round trip, line by line."""
    import torch
    from line_profiler import LineProfiler

    import torch_pagecomp as pc
    from bench.dev_call_profile import warm_cycle

    dev = torch.device("cuda")
    x = torch.randn(a.cycle * 512, device=dev).relu_().to(torch.bfloat16)
    comp = pc.PageCompressor(device=dev)
    cycle = warm_cycle(comp, x, max(16, a.warmup * 50))

    def cycles(n: int) -> None:
        for i in range(n):
            cycle()
            if i % 16 == 15:
                torch.cuda.synchronize()
        torch.cuda.synchronize()

    got = comp.restore(comp.offload(x))
    assert torch.equal(got, x), "round trip not bit-exact"
    prof = LineProfiler()
    for target in (a.functions or ",".join(CYCLE)).split(","):
        prof.add_function(_function(target))
    t0 = time.perf_counter()
    prof.enable_by_count()
    cycles(a.steps)
    prof.disable_by_count()
    us = (time.perf_counter() - t0) * 1e6 / a.steps
    out = io.StringIO()
    prof.print_stats(stream=out, output_unit=1e-6, stripzeros=True)
    print(f"## {a.cycle} KiB bf16 offload + restore + free: {a.steps} cycles, {us:.1f} us a "
          f"cycle profiled")
    print(out.getvalue(), flush=True)
    comp.close()


if __name__ == "__main__":
    main()
