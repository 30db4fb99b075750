"""Dev probe (#25): the CPU path's two codecs for 16-bit float pages side by side, on one
thread.

    python3 -m bench.dev_cpu_codecs TAG [fp16]

For each bf16 corpus (64 MiB of 4 KiB pages; with ``fp16``: the same values as fp16, and
``fp16-randn``, full fp16 mantissas): ratio and GB/s (uncompressed bytes, the median of 5
calls) of ``compress`` and ``decompress(out=)``, ``backend="cpu"``, with LZ4 on 2-byte
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


def _pages(name: str, fp16: bool) -> torch.Tensor:
    """``uint8 [N, 4096]``: 64 MiB of corpus ``name`` (as fp16 values with ``fp16``)."""
    if name == "fp16-randn":
        g = torch.Generator().manual_seed(1)
        return (torch.randn(32 << 20, generator=g) * 0.02).half().view(torch.uint8).view(-1, 4096)
    pages = corpora.build_corpus(name, 64 << 20, 4096, seed=1)
    return pages.view(torch.bfloat16).half().view(torch.uint8) if fp16 else pages


def main() -> None:
    tag = sys.argv[1] if len(sys.argv) > 1 else "run"
    fp16 = len(sys.argv) > 2 and sys.argv[2] == "fp16"
    codecs = ((CODECS[0], ("exp-fp16", {"codec": "exp-fp16"})) if fp16 else CODECS)
    pc.set_cpu_threads(1)
    for name in CORPORA + (("fp16-randn",) if fp16 else ()):
        pages = _pages(name, fp16)
        out = torch.empty_like(pages)
        for label, kw in codecs:
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
