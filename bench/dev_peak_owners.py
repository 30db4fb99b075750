"""Dev probe: what is allocated on the GPU at a training step's peak, and by whom (#21).

``python3 -m bench.dev_peak_owners --models bert-1024 --variants uncompressed,memory``
(GPU): per model and variant, warm-up steps, then a few steps with the CUDA caching
allocator's history recorded (``torch.cuda.memory._record_memory_history``, Python frames);
the history is replayed (:func:`peak_owners`) to the moment ``memory_allocated`` was highest,
and the bytes live then are grouped by owner: the innermost frame of the package
(``torch_pagecomp`` / ``triton_kernels``) that allocated them, else ``other`` (the model,
autograd, the optimizer), and ``before`` (allocated before the recording, less what of it was
freed since); then the package's blocks live at the peak, by call chain and size, and the
chain of the allocation that reached it. ``--fsdp`` under ``torchrun``: the model under FSDP2,
a table per rank.

Why: on BERT-large ``prefer="memory"``'s peak has sat 0.02-0.04 GiB above a plain copy's in
every one-GPU run (``bench/results/h200_0a6fe49_session50``), in the backward; which of the
compressed path's buffers (a restore's staging, slice metadata, statuses, the compressors'
scratch) are live there was not measured.
"""

from __future__ import annotations

import collections
import os

PACKAGE_DIRS = (f"{os.sep}torch_pagecomp{os.sep}", f"{os.sep}triton_kernels{os.sep}")


def _package_frames(frames) -> list[str]:
    """``file.py:function`` of each package frame of an allocation's stack, innermost first."""
    return [f"{os.path.basename(f.get('filename', ''))}:{f.get('name', '?')}"
            for f in frames or () if any(d in f.get("filename", "") for d in PACKAGE_DIRS)]


def owner(frames) -> str:
    """``file.py:function`` of the innermost package frame of an allocation's stack
    (``frames``: the snapshot's dicts, innermost first), else ``"other"``."""
    mine = _package_frames(frames)
    return mine[0] if mine else "other"


def chain(frames, depth: int = 4) -> str:
    """The innermost ``depth`` package frames of a stack, ``inner < caller < ...``, else
    ``"other"``: which path through the package made a block (a restore from a prefetch or
    from an unpack on demand, say)."""
    mine = _package_frames(frames)
    return " < ".join(mine[:depth]) if mine else "other"


def _peak_index(events) -> int:
    """The index of the event at which the replayed total (``alloc`` adds a block's bytes,
    ``free_requested`` takes them off, as ``memory_allocated`` counts them) first reached its
    highest; -1 if it never rose above the start."""
    live: dict[int, int] = {}
    total = best = 0
    at = -1
    for i, e in enumerate(events):
        action = e.get("action")
        if action == "alloc":
            live[e["addr"]] = e["size"]
            total += e["size"]
            if total > best:
                best, at = total, i
        elif action == "free_requested":
            total -= live.pop(e["addr"], e["size"])
    return at


def _live_at(events, at: int) -> tuple[list[tuple[int, object]], int]:
    """``(size, frames)`` of each block allocated in the trace and live after event ``at``,
    and the bytes of blocks allocated before the trace and freed by then (negative)."""
    live: dict[int, tuple[int, object]] = {}
    before = 0
    for e in events[:at + 1]:
        action = e.get("action")
        if action == "alloc":
            live[e["addr"]] = (e["size"], e.get("frames"))
        elif action == "free_requested" and live.pop(e["addr"], None) is None:
            before -= e["size"]
    return list(live.values()), before


def peak_owners(events) -> tuple[int, dict[str, int]]:
    """Replay one device's allocator trace to its highest total (:func:`_peak_index`) and
    return ``(that total, bytes by owner then)``, relative to the start of the trace: a block
    allocated before it and freed during it counts against ``"before"``."""
    live, before = _live_at(events, _peak_index(events))
    by = collections.Counter({"before": before})
    for size, frames in live:
        by[owner(frames)] += size
    return sum(by.values()), {k: v for k, v in by.items() if v}


def peak_blocks(events) -> tuple[collections.Counter, str]:
    """The package's blocks live when the replayed total first reached its highest
    (:func:`_peak_index`): ``Counter((chain, size) -> blocks)``, and the chain of the
    allocation that reached it."""
    at = _peak_index(events)
    live, _ = _live_at(events, at)
    blocks = collections.Counter((chain(fr), size) for size, fr in live
                                 if owner(fr) != "other")
    return blocks, chain(events[at].get("frames")) if at >= 0 else "none"


def measure(name: str, variant: str, steps: int, warmup: int,
            fsdp: bool = False) -> tuple[float, dict, list[str]]:
    """``(peak GiB, GiB by owner at the peak, the package's blocks live then)`` of ``steps``
    training steps of stock model ``name`` under ``variant``'s hooks
    (``bench.dev_hook_timing.training_step``; ``fsdp``: under FSDP2)."""
    import torch

    from bench.dev_hook_timing import training_step

    step, off = training_step(name, variant, fsdp=fsdp)
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
    blocks, peak_chain = peak_blocks(trace)
    detail = [f"{variant}: the allocation that reached the peak: {peak_chain}"] + [
        f"{variant}: {n} x {size / 2**20:.2f} MiB  {ch}"
        for (ch, size), n in sorted(blocks.items(), key=lambda kv: -kv[0][1] * kv[1])]
    at["before"] = at.get("before", 0) + base
    gib = {k: v / 2**30 for k, v in at.items()}
    peak = (base + best) / 2**30
    if off is not None:
        off.remove()
        off.close()
    # the allocator's own peak, to check the replay against
    gib["(max_memory_allocated)"] = torch.cuda.max_memory_allocated() / 2**30
    return peak, gib, detail


def table(name: str, results: dict[str, tuple[float, dict]]) -> list[str]:
    """The owners at each variant's peak, GiB, largest first; a column per variant."""
    variants = list(results)
    owners = sorted({k for _, by, *_ in results.values() for k in by},
                    key=lambda k: -max(by.get(k, 0.0) for _, by, *_ in results.values()))
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
    ap.add_argument("--fsdp", action="store_true",
                    help="the model under FSDP2 over torchrun's ranks (torchrun "
                         "--nproc_per_node 2 -m bench.dev_peak_owners --fsdp); each rank's table")
    ap.set_defaults(models="bert-1024", steps=3)
    a = ap.parse_args()
    if a.fsdp:
        import torch.distributed as dist

        from bench.dev_ab_steps import _process_group, every_rank

        rank = _process_group("cuda")
    for name in a.models.split(","):
        results = {v: measure(name, v, a.steps, a.warmup, a.fsdp) for v in a.variants.split(",")}
        lines = table(name + (f" (FSDP2, rank {rank})" if a.fsdp else ""), results)
        lines += [d for _, _, detail in results.values() for d in detail]
        if a.fsdp:  # every rank's lines, printed by rank 0
            every = every_rank(lines)
            lines = [x for r in every for x in r] if rank == 0 else []
        if lines:
            print("\n".join(lines), flush=True)
    if a.fsdp:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
