"""``PageCompressor``'s one-call path for a small 16-bit float tensor on its GPU (#26).

``PageCompressor.offload`` and ``restore`` take any tensor, handle and target: they check
each argument for every case, make byte views, pick a store, and switch device. On a 1 MiB
bf16 tensor that general path cost ~50 us of the ~125 us of host time an offload + restore
took on an H200's host, beside ~62 us for the small store's own launches and events
(``bench/dev_small_layers``, ``bench/results/h200_session84``).

:class:`SmallTensorPath` takes the common case: a plain contiguous bf16 or fp16 tensor of at
most ``_small_store.SMALL_BYTES`` (and one batch) on the compressor's GPU, the current device,
no CUDA graph being captured; and its restore to a new tensor (or a matching ``out``) on that
GPU without ``check``. Its checks are a few attribute reads, and it hands the tensor itself to
the small store (which launches by address), not a byte view. Anything else returns None,
and the general path takes the call, with the same result: the same stored bytes, handle,
counts and statuses, and its errors by name. It cut a 1 MiB offload + restore's host time by
50-89 us against the general path in the same process (four calls on H200 hosts).
"""

from __future__ import annotations

import torch

from ._direct import SmallStorage
from .api import raise_for_status
from .handles import OffloadHandle
from .offload._streams import current_stream

FP16 = {torch.bfloat16: False, torch.float16: True}  # the dtypes taken: is it fp16


class SmallTensorPath:
    """The one-call path of ``comp`` (a ``PageCompressor`` on a GPU whose kernel-only store
    ``path`` has a small store; see the module docstring)."""

    def __init__(self, comp, path):
        self.comp, self.path = comp, path
        self.device = comp.device
        self.cuda = comp.device.type == "cuda"  # (the CPU: tests, with Triton's interpreter)
        self.index = comp.device.index if self.cuda else -1  # as ``get_device()`` gives
        self.page_size = comp.page_size
        self.limit = min(path.small_bytes, comp.batch_pages * comp.page_size)
        self.pipeline = comp.pipeline
        self.failures = comp.restore_failures

    def _here(self, closed_ok: bool) -> bool:
        """The current device is the compressor's, no graph is captured, and the compressor
        takes the work (``closed_ok``: a restore; the general path raises otherwise, by
        name)."""
        if self.cuda and (torch._C._cuda_getDevice() != self.index
                          or torch.cuda.is_current_stream_capturing()):
            return False
        return self.pipeline._stop_error(closed_ok) is None

    def offload(self, tensor) -> OffloadHandle | None:
        """``comp.offload(tensor)`` for the case taken, else None."""
        if type(tensor) is not torch.Tensor:  # (subclasses: the general path)
            return None
        fp16 = FP16.get(tensor.dtype)
        if (fp16 is None or tensor.is_cuda is not self.cuda or tensor.is_nested
                or tensor.is_meta or tensor.layout is not torch.strided
                or not tensor.is_contiguous() or tensor.is_neg()):
            return None
        nbytes = 2 * tensor.numel()
        if (not 0 < nbytes <= self.limit or tensor.get_device() != self.index
                or not self._here(closed_ok=False)):
            return None
        storage = self.path.offload_small(tensor, nbytes, fp16)
        if storage is None:  # (no page-locked block: the general path stores it elsewhere)
            return None
        handle = OffloadHandle(storage, tensor.shape, tensor.dtype, nbytes, self.page_size, 2)
        self.comp._count(offloads=1, bytes_in=nbytes)
        return handle

    def restore(self, handle, out) -> torch.Tensor | None:
        """``comp.restore(handle, out=out)`` (``out`` None: a new tensor) on this GPU without
        ``check``, for a handle of this path's small store; else None."""
        if type(handle) is not OffloadHandle:
            return None
        storage = handle._storage
        if (type(storage) is not SmallStorage or storage.path is not self.path
                or not handle._free.alive or handle.checksums is not None
                or not self._here(closed_ok=True)):
            return None
        if out is None:
            out = torch.empty(handle.shape, dtype=handle.dtype, device=self.device)
        elif (type(out) is not torch.Tensor or out.dtype != handle.dtype
              or out.is_cuda is not self.cuda
              or out.get_device() != self.index or out.shape != handle.shape
              or not out.is_contiguous() or out.is_neg()):
            return None
        consumer = current_stream(self.device) if self.cuda else None
        status = self.path.restore_small(storage.stored, out, consumer)
        # counted before a raise, as the general path counts
        self.comp._count(restores=1, bytes_restored=handle.nbytes)
        if consumer is None:  # done: checked, as every CPU restore is
            raise_for_status(status)
        else:  # counted on the device: ``failed_restores()``
            self.failures.add([status], consumer, recorded=True)
        return out
