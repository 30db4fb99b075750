"""torch-pagecomp: LZ4 compression of GPU memory pages for PyTorch offload."""

from . import _ops  # noqa: F401  (registers torch.ops.pagecomp.*)
from .api import compress, decompress, pack
from .backend import GpuStatus, gpu_status, select_backend
from .format import (
    DEFAULT_PAGE_SIZE,
    KIND_FILL,
    KIND_LZ4,
    KIND_RAW,
    CompressedPages,
    CorruptPageError,
    PageCompError,
)

__all__ = [
    "DEFAULT_PAGE_SIZE",
    "KIND_FILL",
    "KIND_LZ4",
    "KIND_RAW",
    "CompressedPages",
    "CorruptPageError",
    "GpuStatus",
    "PageCompError",
    "compress",
    "decompress",
    "gpu_status",
    "pack",
    "select_backend",
]
