"""What the offload hooks' CPU review tests share: the modes and an offloader on the CPU path
whose groups follow ``next_group()`` and that offloads whatever compresses."""

from __future__ import annotations

from torch_pagecomp.offload import ActivationOffloader, offload_activations

MODES = ("compressed", "uncompressed")


def cpu_off(mode: str, **kw) -> ActivationOffloader:
    """An offloader of ``mode`` on the CPU path (``offload_cpu``), ``prefer="memory"`` with no
    ratio floor, a group per ``next_group()``, tensors from 0 bytes (``kw`` overrides)."""
    kw.setdefault("min_offload_bytes", 0)
    kw.setdefault("group_bytes", None)
    return offload_activations(mode=mode, offload_cpu=True, prefer="memory", min_ratio=0.0,
                               **kw)
