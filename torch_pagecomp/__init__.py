"""torch-pagecomp: LZ4 compression of GPU memory pages for PyTorch offload."""

from . import _ops  # noqa: F401  (registers torch.ops.pagecomp.*)
from ._version import __version__
from .api import compress, decompress, pack, page_checksums, raise_for_status
from .backend import GpuStatus, gpu_status, select_backend
from .cpu_codec import cpu_threads, empty_cpu_cache, set_cpu_threads
from .format import (
    DEFAULT_PAGE_SIZE,
    KIND_EXP,
    KIND_FILL,
    KIND_LZ4,
    KIND_RAW,
    CompressedPages,
    CorruptPageError,
    PageCompError,
)
from .module import OffloadHandle, PageCompressor, SlotState, dtype_element_size
from .offload import (
    ActivationOffloader,
    StepTuner,
    keep_on_gpu,
    offload_activations,
    offload_module,
)

__all__ = [
    "__version__",
    "DEFAULT_PAGE_SIZE",
    "KIND_EXP",
    "KIND_FILL",
    "KIND_LZ4",
    "KIND_RAW",
    "ActivationOffloader",
    "CompressedPages",
    "CorruptPageError",
    "GpuStatus",
    "OffloadHandle",
    "PageCompError",
    "PageCompressor",
    "SlotState",
    "StepTuner",
    "compress",
    "cpu_threads",
    "decompress",
    "dtype_element_size",
    "empty_cpu_cache",
    "gpu_status",
    "keep_on_gpu",
    "offload_activations",
    "offload_module",
    "pack",
    "page_checksums",
    "raise_for_status",
    "select_backend",
    "set_cpu_threads",
]
