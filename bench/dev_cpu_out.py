"""The host path's ``out=``: GB/s of ``compress`` / ``decompress`` (``backend="cpu"``) into new
tensors, into the caller's (``out=``), and as ``out=`` ran before the host path wrote it in place
(a new result copied over), each corpus at each thread count, in alternated rounds.

    python3 -m bench.dev_cpu_out [--mib 128] [--threads 1,2] [--rounds 7]
                                 [--corpora text,mixed,bf16-relu]

GB/s of uncompressed bytes, the median of ``--rounds`` calls; every ``out=`` result is checked
against the call that allocates.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import torch_pagecomp as pc

from . import corpora


def _arms(pages: torch.Tensor, e: int) -> dict:
    """The six calls timed for one corpus, by name."""
    c = pc.compress(pages, element_size=e, backend="cpu")
    into = torch.zeros_like(pages)
    cout = pc.compress(pages, element_size=e, backend="cpu")
    parts = (cout.payload, cout.sizes, cout.kinds)

    def compress_copied():
        got = pc.compress(pages, element_size=e, backend="cpu")
        return [o.copy_(t) for o, t in zip(parts, (got.payload, got.sizes, got.kinds))]

    return {
        "decompress, new": lambda: pc.decompress(c, backend="cpu"),
        "decompress, out= as before (new + copy)":
            lambda: into.copy_(pc.decompress(c, backend="cpu")),
        "decompress, out=": lambda: pc.decompress(c, backend="cpu", out=into),
        "compress, new": lambda: pc.compress(pages, element_size=e, backend="cpu"),
        "compress, out= as before (new + copy)": compress_copied,
        "compress, out=": lambda: pc.compress(pages, element_size=e, backend="cpu", out=cout),
    }, (c, into, cout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=128)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--corpora", default="text,mixed,bf16-relu")
    args = ap.parse_args()
    print(f"{'corpus':10s} {'threads':>7s}  {'call':40s} {'GB/s':>6s}")
    for name in args.corpora.split(","):
        pages = corpora.build_corpus(name, args.mib << 20, 4096, seed=1)
        e = corpora.element_size(name)
        arms, (c, into, cout) = _arms(pages, e)
        for t in (int(x) for x in args.threads.split(",")):
            pc.set_cpu_threads(t)
            for fn in arms.values():
                fn()  # warm-up
            want = pc.compress(pages, element_size=e, backend="cpu")
            assert torch.equal(cout.payload, want.payload), "compress out= differs"
            assert torch.equal(into, pages), "decompress out= differs"
            times: dict = {k: [] for k in arms}
            for _ in range(args.rounds):
                for k, fn in arms.items():
                    start = time.perf_counter()
                    fn()
                    times[k].append(time.perf_counter() - start)
            for k, v in times.items():
                gbps = pages.numel() / statistics.median(v) / 1e9
                print(f"{name:10s} {t:7d}  {k:40s} {gbps:6.2f}", flush=True)
    pc.set_cpu_threads(None)


if __name__ == "__main__":
    main()
