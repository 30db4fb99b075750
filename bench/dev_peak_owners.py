"""Dev probe: what is allocated on the GPU at a training step's peak, and by whom (#21).

``python3 -m bench.dev_peak_owners --models bert-1024 --variants uncompressed,memory``
(GPU): per model and variant, warm-up steps, then a few steps with the CUDA caching
allocator's history recorded (``torch.cuda.memory._record_memory_history``, Python frames);
the history is replayed (:func:`peak_owners`) to the moment ``memory_allocated`` was highest,
and the bytes live then are grouped by owner: the innermost frame of the package
(``torch_pagecomp`` / ``triton_kernels``) that allocated them, else ``other`` (the model,
autograd, the optimizer), and ``before`` (allocated before the recording, less what of it was
freed since). With two variants, the owners' difference too.

Why: on BERT-large ``prefer="memory"``'s peak has sat 0.02-0.04 GiB above a plain copy's in
every one-GPU run (``bench/results/h200_0a6fe49_session50``), in the backward; which of the
compressed path's buffers (a restore's staging, slice metadata, statuses, the compressors'
scratch) are live there was not measured.
"""

from __future__ import annotations

import collections
import os

PACKAGE_DIRS = (f"{os.sep}torch_pagecomp{os.sep}", f"{os.sep}triton_kernels{os.sep}")


def owner(frames) -> str:
    """``file.py:function`` of the innermost package frame of an allocation's stack
    (``frames``: the snapshot's dicts, innermost first), else ``"other"``."""
    for f in frames or ():
        name = f.get("filename", "")
        if any(d in name for d in PACKAGE_DIRS):
            return f"{os.path.basename(name)}:{f.get('name', '?')}"
    return "other"


def peak_owners(events) -> tuple[int, dict[str, int]]:
    """Replay one device's allocator trace (``alloc`` adds a block's bytes, ``free_requested``
    takes them off, as ``memory_allocated`` counts them) and return ``(highest total reached,
    bytes by owner then)``, relative to the start of the trace: a block allocated before it
    and freed during it counts against ``"before"``."""
    live: dict[int, tuple[int, str]] = {}
    by = collections.Counter()
    total = best = 0
    at_best: dict[str, int] = {}
    for e in events:
        action = e.get("action")
        if action == "alloc":
            who = owner(e.get("frames"))
            live[e["addr"]] = (e["size"], who)
            by[who] += e["size"]
            total += e["size"]
            if total > best:
                best, at_best = total, {k: v for k, v in by.items() if v}
        elif action == "free_requested":
            size, who = live.pop(e["addr"], (e["size"], "before"))
            by[who] -= size
            total -= size
    return best, at_best


def measure(name: str, variant: str, steps: int, warmup: int) -> tuple[float, dict]:
    """``(peak GiB, GiB by owner at the peak)`` of ``steps`` training steps of stock model
    ``name`` under ``variant``'s hooks (``bench.dev_hook_timing.training_step``)."""
    import torch

    from bench.dev_hook_timing import training_step

    step, off = training_step(name, variant)
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    try:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    trace = snap["device_traces"][torch.cuda.current_device()]
    best, at = peak_owners(trace)
    at["before"] = at.get("before", 0) + base
    gib = {k: v / 2**30 for k, v in at.items()}
    peak = (base + best) / 2**30
    if off is not None:
        off.remove()
        off.close()
    # the allocator's own peak, to check the replay against
    gib["(max_memory_allocated)"] = torch.cuda.max_memory_allocated() / 2**30
    return peak, gib


def table(name: str, results: dict[str, tuple[float, dict]]) -> list[str]:
    """The owners at each variant's peak, GiB, largest first; a column per variant."""
    variants = list(results)
    owners = sorted({k for _, by in results.values() for k in by},
                    key=lambda k: -max(by.get(k, 0.0) for _, by in results.values()))
    lines = [f"## {name}: GiB live at each variant's peak, by owner",
             "| owner | " + " | ".join(variants) + " |",
             "|---|" + "---|" * len(variants),
             "| **peak (replayed)** | " + " | ".join(f"{results[v][0]:.3f}" for v in variants)
             + " |"]
    for k in owners:
        lines.append(f"| {k} | " + " | ".join(f"{results[v][1].get(k, 0.0):.3f}"
                                             for v in variants) + " |")
    return lines


def main() -> None:
    from bench.dev_hook_timing import stock_parser

    ap = stock_parser("uncompressed,memory")  # --models, --variants, --steps, --warmup
    ap.set_defaults(models="bert-1024", steps=3)
    a = ap.parse_args()
    for name in a.models.split(","):
        results = {v: measure(name, v, a.steps, a.warmup) for v in a.variants.split(",")}
        print("\n".join(table(name, results)), flush=True)


if __name__ == "__main__":
    main()
