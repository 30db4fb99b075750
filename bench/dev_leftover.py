"""Dev probe: the GPU memory one model's measurement leaves allocated for the next (#21).

``torchrun --standalone --nproc_per_node 2 -m bench.dev_leftover --fsdp --models
bert-1024,encoder-1024 --arms uncompressed,memory,none`` (GPU; without ``--fsdp`` and
``torchrun``, one GPU): runs ``bench.dev_ab_steps.measure`` for each model in turn (one round),
with the caching allocator's history recorded (Python frames), and after each, once the
measurement has returned and the garbage is collected, prints the bytes still allocated,
grouped by the innermost frames that allocated them (rank 0's, and every rank's total).

Why: under FSDP2 the interleaved bench's later models started on GPU memory the earlier ones
left allocated, growing model after model (0 to 1.67 GiB over eight models,
``bench/results/h200x2_b5a72ad_session51``); a model measured third in its process ran 1.26x
a plain copy's step, and 1.03x first in a process of its own
(``bench/results/h200x2_de2195a_session53``). Whether that memory is the package's (an
offloader that outlives its close) or the bench's was not known.
"""

from __future__ import annotations

import argparse
import collections
import gc
import os


def frames_key(frames, depth: int = 3) -> str:
    """The innermost ``depth`` Python frames of an allocation, ``file:line:function`` each,
    innermost first ("?" where the history has none)."""
    names = [f"{os.path.basename(f.get('filename', '?'))}:{f.get('line', '?')}:"
             f"{f.get('name', '?')}" for f in frames or ()
             if f.get("filename", "").endswith(".py")]
    return " < ".join(names[:depth]) or "?"


def leftover(snapshot, device: int) -> collections.Counter:
    """Bytes of the blocks allocated on ``device`` in ``snapshot``
    (``torch.cuda.memory._snapshot()``), by :func:`frames_key` of the frames that made them."""
    by: collections.Counter = collections.Counter()
    for seg in snapshot["segments"]:
        if seg.get("device") != device:
            continue
        for block in seg["blocks"]:
            if block["state"] == "active_allocated":
                by[frames_key(block.get("frames"))] += block["size"]
    return by


def describe(obj) -> str:
    """A short name for an object on a chain of referrers."""
    import types

    if isinstance(obj, dict):
        return f"dict(keys={list(obj)[:6]})"
    if isinstance(obj, (list, tuple, set)):
        return f"{type(obj).__name__}(len={len(obj)})"
    if isinstance(obj, types.FrameType):
        return f"frame {obj.f_code.co_filename.rsplit('/', 1)[-1]}:{obj.f_code.co_name}"
    if isinstance(obj, types.FunctionType):
        return f"function {obj.__qualname__}"
    if isinstance(obj, types.MethodType):
        return f"method {obj.__func__.__qualname__}"
    if isinstance(obj, types.CellType):
        return "cell"
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def referrers(target, depth: int = 6, width: int = 4) -> list[str]:
    """What keeps ``target`` alive: its referrers, theirs, ..., ``depth`` levels up (at most
    ``width`` a level; this probe's own frames and lists left out)."""
    import sys

    lines, seen = [], {id(target)}
    level = [target]
    for d in range(depth):
        nxt = []
        for obj in level:
            refs = [r for r in gc.get_referrers(obj) if id(r) not in seen
                    and r is not level and r is not nxt and r is not sys._getframe()]
            for r in refs[:width]:
                seen.add(id(r))
                lines.append(f"{'  ' * (d + 1)}<- {describe(r)}")
                nxt.append(r)
        level = nxt
        if not level:
            break
    return lines


def alive_models() -> list:
    """The ``torch.nn.Module`` objects alive that no other alive module holds as a child."""
    import torch

    mods = [o for o in gc.get_objects() if isinstance(o, torch.nn.Module)]
    children = {id(c) for m in mods for c in m.children()}
    return [m for m in mods if id(m) not in children]


def main() -> None:
    import torch

    from bench.dev_ab_steps import _process_group, measure

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="bert-1024,encoder-1024")
    ap.add_argument("--arms", default="uncompressed,memory,none")
    ap.add_argument("--fsdp", action="store_true")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--referrers", action="store_true",
                    help="also what keeps the first model left alive alive")
    a = ap.parse_args()
    rank = _process_group("cuda") if a.fsdp else 0
    dev = torch.cuda.current_device()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    try:
        for name in a.models.split(","):
            measure(name, a.arms.split(","), 1, 1, fsdp=a.fsdp)
            gc.collect()
            torch.cuda.synchronize()
            left = leftover(torch.cuda.memory._snapshot(), dev)
            total = torch.cuda.memory_allocated()
            lines = [f"## after {name}: {total / 2**30:.3f} GiB allocated on rank {rank} "
                     f"({sum(left.values()) / 2**30:.3f} GiB in blocks with a history)"]
            lines += [f"  {b / 2**20:9.1f} MiB  {k}" for k, b in left.most_common(a.top)]
            if a.fsdp:
                from bench.dev_ab_steps import every_rank

                lines[0:1] = every_rank(lines[0])
            roots = alive_models()
            lines.append(f"  models alive: {[type(m).__name__ for m in roots][:8]}")
            if roots and a.referrers:
                lines += referrers(roots[0])
            del roots
            if rank == 0:
                print("\n".join(lines), flush=True)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    if a.fsdp:
        import torch.distributed as dist

        from bench.stock_models import end_process_group

        end_process_group(dist.get_backend() == "nccl")


if __name__ == "__main__":
    main()
