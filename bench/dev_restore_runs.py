"""Dev probe: how many host-to-device copies a batched restore issues, and what the hooks'
per-tensor primitives cost the host on a GPU (#21).

``python3 -m bench.dev_restore_runs --models bert-1024,encoder-1024 --steps 3`` (GPU):

* per model, a few warm steps under ``prefer="memory"``, then ``--steps`` steps with
  ``_paged_group.restore_placed`` and ``_copies.copy_spans`` wrapped: per batched restore the
  stored tensors, slices, runs of adjacent arena bytes (one ``copy_spans`` each) and copies
  (one per chunk a run lies in), and the gaps between runs (arena bytes not copied): would
  copying small gaps too save driver calls at little link cost?
* the host microseconds of the primitives the hooks call for every saved tensor (a typed view
  of a storage, as ``_Packed.view`` and ``_hooks._offload`` make it, against a view op of a
  typed base; a small device allocation; an event record; one ``cuMemcpyHtoDAsync``), with
  the GPU kept busy so nothing waits on it.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bench.timing import host_rounds_us


def _quantiles(xs: list[int]) -> str:
    if not xs:
        return "-"
    xs = sorted(xs)
    pick = [xs[int(q * (len(xs) - 1))] for q in (0.1, 0.5, 0.9)]
    return " / ".join(f"{v / 1024:.0f}K" for v in pick)


def runs_of(name: str, steps: int, warmup: int) -> list[str]:
    """The batched restores' copies on stock model ``name`` under ``prefer="memory"``."""
    from bench.dev_hook_timing import training_step
    from torch_pagecomp.offload import _backward, _copies

    step, off = training_step(name, "memory")
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    calls = []  # per restore_placed: (storeds, slices, runs, copies, bytes, gaps)
    spans = [0]
    orig_restore, orig_copy = _backward.restore_placed, _copies.copy_spans

    def copy_spans(dst, sp):
        spans[0] += len(sp)
        return orig_copy(dst, sp)

    def restore_placed(store, storeds, outs):
        before = spans[0]
        ok = orig_restore(store, storeds, outs)
        if ok:
            sls = sorted({id(sl): sl for s in storeds for sl in s.slices}.values(),
                         key=lambda sl: sl.base)
            gaps, runs = [], 1
            for a, b in zip(sls, sls[1:]):
                gap = b.base - (a.base + a.total)
                if gap:
                    runs += 1
                    gaps.append(gap)
            calls.append((len(storeds), len(sls), runs, spans[0] - before,
                          sum(sl.total for sl in sls), gaps))
        return ok

    _backward.restore_placed, _copies.copy_spans = restore_placed, copy_spans
    try:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    finally:
        _backward.restore_placed, _copies.copy_spans = orig_restore, orig_copy
        off.remove()
    if not calls:
        return [f"## {name}: no batched restore ran"]
    gaps = [g for c in calls for g in c[5]]
    small = [g for g in gaps if g <= 256 << 10]
    med = lambda k: statistics.median(c[k] for c in calls)  # noqa: E731
    return [f"## {name} (memory): {len(calls) / steps:.0f} batched restores a step",
            "| per restore (median) | tensors | slices | runs | copies | MiB |",
            "|---|---|---|---|---|---|",
            f"| | {med(0):.0f} | {med(1):.0f} | {med(2):.0f} | {med(3):.0f} | "
            f"{med(4) / 2**20:.1f} |",
            f"copies a step {sum(c[3] for c in calls) / steps:.0f}; gaps a step "
            f"{len(gaps) / steps:.0f} (p10 / p50 / p90 {_quantiles(gaps)}); of them <= 256 KiB "
            f"{len(small) / steps:.0f}, {sum(small) / steps / 2**20:.2f} MiB a step"]


def _empty_on(stream, dev) -> torch.Tensor:
    with torch.cuda.stream(stream):
        return torch.empty(4096, dtype=torch.int64, device=dev)


def primitives(calls: int) -> list[str]:
    """Host us per call of the hooks' per-tensor primitives (the GPU busy meanwhile)."""
    from torch_pagecomp.offload._copies import _memcpy_htod, copy_spans

    dev = torch.device("cuda")
    t = torch.randn(4096, 1024, device=dev, dtype=torch.bfloat16)
    storage = t.untyped_storage()
    u8 = torch.empty((0,), dtype=torch.uint8, device=dev).set_(storage)
    typed = u8.view(torch.bfloat16)
    size, stride = t.size(), t.stride()
    host = torch.empty(256 << 10, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(256 << 10, dtype=torch.uint8, device=dev)
    side = torch.cuda.Stream()
    busy = torch.empty(64 << 20, dtype=torch.uint8, device=dev)

    def keep_busy():  # queued work, so no primitive below waits for the GPU
        for _ in range(20):
            busy.add_(1)

    cases = {
        "empty((0,)).set_(storage, off, size, stride)":
            lambda: torch.empty((0,), dtype=torch.bfloat16, device=storage.device).set_(
                storage, 0, size, stride),
        "empty((0,)).set_(storage) [uint8]":
            lambda: torch.empty((0,), dtype=torch.uint8, device=dev).set_(storage),
        "typed_base.as_strided(size, stride, off)": lambda: typed.as_strided(size, stride, 0),
        "u8.view(dtype).as_strided(...)":
            lambda: u8.view(torch.bfloat16).as_strided(size, stride, 0),
        "torch.empty(4096, int64) [side stream]": lambda: _empty_on(side, dev),
        "Event.record": lambda: torch.cuda.Event().record(),
        "cuMemcpyHtoDAsync 256 KiB (copy_spans, 1 span)":
            lambda: copy_spans(dst, [(0, host.data_ptr(), 256 << 10)]),
        "cuMemcpyHtoDAsync 4 KiB": lambda: copy_spans(dst, [(0, host.data_ptr(), 4096)]),
    }
    lines = ["## the hooks' primitives: host us a call (median of 5 rounds of "
             f"{calls}; the driver copy {'on' if _memcpy_htod() else 'OFF'})",
             "| primitive | us |", "|---|---|"]
    for label, fn in cases.items():
        keep_busy()
        us = statistics.median(host_rounds_us(fn, calls, 5, after=keep_busy))
        lines.append(f"| {label} | {us:.2f} |")
    torch.cuda.synchronize()
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="bert-1024,encoder-1024")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--calls", type=int, default=2000)
    a = ap.parse_args()
    for line in primitives(a.calls):
        print(line, flush=True)
    for name in a.models.split(","):
        print("\n".join(runs_of(name, a.steps, a.warmup)), flush=True)


if __name__ == "__main__":
    main()
