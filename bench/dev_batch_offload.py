"""Dev probe (#21): what storing several saved tensors as one slice saves the host.

``python3 -m bench.dev_batch_offload [--mib 1,4,16] [--batch 1,4,16] [--rounds 20]`` (GPU;
on the CPU the Triton interpreter runs it at toy sizes). A compressed saved tensor costs the
activation hooks ~300-450 us more host time than a plain copy, where the driver's own part
is ~50 us (``bench/results/h200_967571b_session41``). Most of that is paid per stored tensor:
the store's Python around two launches and three events each way. This probe measured the
lever before it was built (``offload/_batch.py`` since 85aadd2; its run:
``bench/results/h200_0991b9a_session42/batch_offload_0991b9a.txt``): ``batch`` bf16 tensors
of ``mib`` MiB each, stored and restored

* **one by one**: ``PagedStore.offload`` of each, then ``PagedStore.restore`` of each into its
  own buffer (what the hooks do per saved tensor);
* **as one**: ``torch.cat`` of their bytes on the compute stream (one launch; the sources
  could go once it is queued, the batch once stored), one ``offload`` of that, one
  ``restore`` into one buffer that the tensors would be views of.

Printed per case: the median host us per tensor of each way (offload and restore apart), the
ratio, and whether every restored byte matches. The GPU time of the extra device-to-device copy
is not counted: at HBM speed it is a few percent of the link time it adds to.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.corpora import build_corpus


def _store(dev: torch.device):
    from torch_pagecomp.offload._paged import PagedStore

    streams = (tuple(torch.cuda.Stream(device=dev) for _ in range(3)) if dev.type == "cuda"
               else (None, None, None))
    return PagedStore(dev, 4096, streams)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def one_case(store, tensors: list[torch.Tensor], rounds: int) -> dict:
    """Host us per tensor of both ways over ``rounds`` rounds (the first two not counted),
    and whether every restore gave the bytes back."""
    dev = tensors[0].device
    cur = torch.cuda.current_stream(dev) if dev.type == "cuda" else None
    flat = [t.view(-1).view(torch.uint8) for t in tensors]
    k = len(flat)
    times = {"one_off": [], "one_res": [], "batch_off": [], "batch_res": []}
    ok = True
    for r in range(rounds + 2):
        _sync(dev)
        t0 = time.perf_counter_ns()
        stored = [store.offload(f, 2, cur, float_format="bf16") for f in flat]
        t1 = time.perf_counter_ns()
        outs = [torch.empty_like(f) for f in flat]
        t2 = time.perf_counter_ns()
        for s, o in zip(stored, outs):
            store.restore(s, o)
        t3 = time.perf_counter_ns()
        _sync(dev)
        ok &= all(torch.equal(o, f) for o, f in zip(outs, flat))
        for s in stored:
            store.free(s)
        store.poll()
        _sync(dev)
        t4 = time.perf_counter_ns()
        batch = torch.cat(flat)  # kept until the sync below: the store's compress stream
        whole = store.offload(batch, 2, cur, float_format="bf16")  # reads it (as the hooks
        t5 = time.perf_counter_ns()  # keep a saved tensor in their stash until stored)
        out = torch.empty(sum(f.numel() for f in flat), dtype=torch.uint8, device=dev)
        t6 = time.perf_counter_ns()
        store.restore(whole, out)
        views = out.split([f.numel() for f in flat])
        t7 = time.perf_counter_ns()
        _sync(dev)
        ok &= all(torch.equal(v, f) for v, f in zip(views, flat))
        del batch
        store.free(whole)
        store.poll()
        if r >= 2:
            times["one_off"].append((t1 - t0) / 1e3 / k)
            times["one_res"].append((t3 - t2) / 1e3 / k)
            times["batch_off"].append((t5 - t4) / 1e3 / k)
            times["batch_res"].append((t7 - t6) / 1e3 / k)
    med = {name: statistics.median(v) for name, v in times.items()}
    med["ok"] = ok
    return med


def main(argv=None) -> list[str]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", default="1,4,16", help="MiB per tensor (fractions allowed)")
    ap.add_argument("--batch", default="1,4,16", help="tensors per batch")
    ap.add_argument("--rounds", type=int, default=20)
    a = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    store = _store(dev)
    lines = ["| MiB a tensor | tensors | offload us a tensor: one by one / as one | restore us "
             "a tensor: one by one / as one | both, one by one / as one | bytes back |",
             "|---|---|---|---|---|---|"]
    try:
        for mib in (float(m) for m in a.mib.split(",")):
            nbytes = max(4096, int(mib * (1 << 20)) // 4096 * 4096)
            for k in (int(b) for b in a.batch.split(",")):
                tensors = [build_corpus("bf16-relu", nbytes, 4096, dev, seed=i).view(-1)
                           for i in range(k)]
                m = one_case(store, tensors, a.rounds)
                one = m["one_off"] + m["one_res"]
                both = m["batch_off"] + m["batch_res"]
                lines.append(f"| {mib:g} | {k} | {m['one_off']:.1f} / {m['batch_off']:.1f} | "
                             f"{m['one_res']:.1f} / {m['batch_res']:.1f} | "
                             f"{one / both:.2f}x | {m['ok']} |")
    finally:
        store.close()
    print("\n".join(lines), flush=True)
    return lines


if __name__ == "__main__":
    main()
