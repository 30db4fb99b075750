"""Dev probe: where the host arena's end lands for the stock models' saved tensors, with slices
that must fit inside one chunk (the rule until 0c4f246) and with slices placed end to end.

``python -m bench.dev_arena_model`` (CPU; the models run on the meta device, so no memory or
time is spent): the sizes of the storages each model saves in a forward pass (those of at
least 1 MiB), cut into slices of ``SLICE_BYTES``, each stored at ``1 / ratio`` of its size.
"""

from __future__ import annotations

import argparse

import torch

from bench import stock_models
from torch_pagecomp.offload._arena import CHUNK_BYTES
from torch_pagecomp.offload._paged import SLICE_BYTES

GIB = 1 << 30


def saved_sizes(name: str) -> list[int]:
    """Bytes of each storage ``name`` saves for backward (``stock_models.MODELS``), in order,
    each once, parameters left out."""
    with torch.device("meta"):
        model, shape = stock_models.model_and_shape(name)
        model = model.to(torch.bfloat16)
        x = torch.randn(shape, dtype=torch.bfloat16, requires_grad=True)
    sizes: list[int] = []
    seen = {p.untyped_storage()._cdata for p in model.parameters()}  # the hooks keep those

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in seen:  # a storage saved again is offloaded once
            seen.add(storage._cdata)
            sizes.append(storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).sum()
    return sizes


def arena_end(slices: list[int], inside_one_chunk: bool) -> int:
    """The arena's end after placing ``slices`` (stored bytes each) one after another."""
    end = 0
    for s in slices:
        if inside_one_chunk and end % CHUNK_BYTES + s > CHUNK_BYTES:
            end = (end // CHUNK_BYTES + 1) * CHUNK_BYTES
        end += s
    return end


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="encoder-1024,resnet-64,llama-2048,encoder-2048")
    ap.add_argument("--ratio", type=float, default=1.42)
    a = ap.parse_args()
    print(f"slices of {SLICE_BYTES >> 20} MiB, chunks of {CHUNK_BYTES >> 20} MiB, "
          f"ratio {a.ratio}")
    print("| model | storages | saved GiB | stored GiB | end, inside one chunk | end to end |")
    print("|---|---|---|---|---|---|")
    for name in a.models.split(","):
        sizes = [s for s in saved_sizes(name) if s >= 1 << 20]
        slices = [int(min(SLICE_BYTES, s - at) / a.ratio) // 16 * 16
                  for s in sizes for at in range(0, s, SLICE_BYTES)]
        print(f"| {name} | {len(sizes)} | {sum(sizes) / GIB:.2f} | {sum(slices) / GIB:.2f} | "
              f"{arena_end(slices, True) / GIB:.2f} | {arena_end(slices, False) / GIB:.2f} |")


if __name__ == "__main__":
    main()
