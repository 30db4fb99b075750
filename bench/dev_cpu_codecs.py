"""Dev probe (#25): the CPU path's two codecs for bf16 pages side by side, on one thread.

    python3 -m bench.dev_cpu_codecs TAG

For each bf16 corpus (64 MiB of 4 KiB pages): ratio and GB/s (uncompressed bytes, the median
of 5 calls) of ``compress`` and ``decompress(out=)``, ``backend="cpu"``, with LZ4 on 2-byte
bit-shuffled elements and with the exponent codec; every round trip checked. Each line starts
with TAG: run it once per build of ``_native`` to compare builds.
"""

from __future__ import annotations

import sys

import torch

import torch_pagecomp as pc

from . import corpora
from .cpu_threads import _median_s

CORPORA = ("gpt-act", "gpt-kv", "gpt-weights", "bf16-randn", "bf16-relu")
CODECS = (("lz4 e=2", {"element_size": 2}), ("exp-bf16", {"codec": "exp-bf16"}))


def main() -> None:
    tag = sys.argv[1] if len(sys.argv) > 1 else "run"
    pc.set_cpu_threads(1)
    for name in CORPORA:
        pages = corpora.build_corpus(name, 64 << 20, 4096, seed=1)
        out = torch.empty_like(pages)
        for label, kw in CODECS:
            c = pc.compress(pages, backend="cpu", **kw)
            pc.decompress(c, backend="cpu", out=out)
            assert torch.equal(out, pages), f"{name} {label}: round trip"
            comp = _median_s(lambda p=pages, kw=kw: pc.compress(p, backend="cpu", **kw), 5)
            dec = _median_s(lambda c=c, o=out: pc.decompress(c, backend="cpu", out=o), 5)
            nb = pages.numel()
            print(f"{tag} {name:12s} {label:9s} ratio {c.ratio():.3f} "
                  f"compress {nb / comp / 1e9:.2f} decompress {nb / dec / 1e9:.2f}", flush=True)


if __name__ == "__main__":
    main()
