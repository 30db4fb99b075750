"""Dev probe: line by line, where the hooks' compressed store and restore spend host time (#21).

``python3 -m bench.dev_line_profile --models bert-1024 --variant memory --steps 4`` (GPU; needs
``line_profiler``, a dev tool carried as a wheel, never a dependency): a few warm steps of a
stock model under ``variant``'s hooks, then ``--steps`` steps with ``line_profiler`` on the
functions in ``--functions`` (``module:qualname``; by default the batched restore, the
statuses' count and the slice store). Prints each function's lines with hits and host us per
hit. Line tracing inflates every line by about the same fixed cost, so compare lines with
each other, not with ``bench.dev_hook_timing``'s totals.
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
    ap.add_argument("--functions", default=",".join(DEFAULT))
    a = ap.parse_args()
    for name in a.models.split(","):
        step, off = training_step(name, a.variant)
        for _ in range(a.warmup):
            step()
        torch.cuda.synchronize()
        prof = LineProfiler()
        for target in a.functions.split(","):
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


if __name__ == "__main__":
    main()
