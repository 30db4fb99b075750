"""Which compression path can run here, and why not: the GPU status probe and the one backend
decision, :func:`route`, that the public API, the ops and :func:`select_backend` all ask."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ._args import check_int
from .format import PageCompError
from .kernels.launch import interpreting

BACKENDS = ("auto", "cpu", "triton")

# Routes: where one compress or decompress call runs (see route()).
CPU = "cpu"
CPU_SERVED = "cpu-served"
KERNELS = "kernels"
OP = "op"
INTERPRET = "interpret"
UPLOAD = "upload"

# Below this many pages, a batch that lives in host memory is compressed on the CPU: the
# upload, launch and download cost more than the lz4 calls.
MIN_GPU_BATCH_PAGES = 256


@dataclass(frozen=True)
class GpuStatus:
    """Result of :func:`gpu_status`. ``usable`` is True when the Triton kernels can run."""

    usable: bool
    reason: str
    device_name: str | None = None
    torch_version: str = torch.__version__
    triton_version: str | None = None


@functools.cache
def gpu_status() -> GpuStatus:
    """Probe, once, whether the GPU path is usable: CUDA build, driver, device, Triton."""
    try:
        import triton

        version, triton_error = triton.__version__, ""
    except Exception as exc:  # noqa: BLE001 - any import failure means no Triton
        version, triton_error = None, f"Triton is not importable ({type(exc).__name__}: {exc})"
    no = lambda reason, name=None: GpuStatus(False, reason, name, triton_version=version)
    if torch.version.cuda is None:
        return no("torch is a CPU-only build (no CUDA)")
    try:
        if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
            return no("no CUDA driver or no CUDA device visible")
        name = torch.cuda.get_device_name(0)
        major, _ = torch.cuda.get_device_capability(0)
    except Exception as exc:  # noqa: BLE001
        return no(f"CUDA driver error: {exc}")
    if version is None:
        return no(triton_error, name)
    if major < 7:
        return no(f"{name} is older than compute capability 7.0", name)
    if interpreting():
        return no("TRITON_INTERPRET=1 runs Triton on the CPU", name)
    return GpuStatus(True, "ok", name, triton_version=version)


def eager_call_ok(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether an eager call may run an op's implementation itself instead of going through the
    ``torch.ops.pagecomp`` dispatch (same code, same results; the dispatch's host time per
    call can exceed the work's own). Never under ``torch.compile``, a dispatch mode
    (``make_fx``, fake tensors) or a tensor subclass: those see the ops."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0:
        return False
    return all(type(t) is torch.Tensor for t in tensors)


def direct_launch_ok(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether an eager call on the GPU may launch the kernels itself (:func:`eager_call_ok`,
    CUDA inputs, not under the interpreter)."""
    return (not interpreting() and eager_call_ok(tensors)
            and all(t.is_cuda for t in tensors))


def route(
    backend: str,
    num_pages: int | None,
    device: torch.device | str,
    tensors: Sequence[torch.Tensor] | None = None,
) -> str:
    """The one backend decision: where a call on ``num_pages`` pages held on ``device`` runs.

    Args:
        backend: what the caller asked for, one of ``BACKENDS``.
        num_pages: the batch size; ``None`` inside an op, where the tensors stay where they are
            (a host batch is never sent through the GPU).
        tensors: the call's inputs when the caller launches it itself: they decide between
            ``KERNELS`` and ``OP``. ``None``: only which backend counts (``KERNELS`` then
            stands for the Triton kernels either way).

    Returns:
        ``CPU``: lz4 on the host (CUDA inputs copied down, the outputs back). ``CPU_SERVED``:
        CUDA inputs without a usable GPU path: the ops' lz4 reference, on copies. ``KERNELS``:
        CUDA inputs, the Triton kernels launched directly (:func:`direct_launch_ok`). ``OP``:
        CUDA inputs, the kernels through ``torch.ops.pagecomp``. ``INTERPRET``: host inputs,
        the kernels under ``TRITON_INTERPRET=1``. ``UPLOAD``: host inputs sent through the GPU
        and back (``"auto"``: batches of at least ``MIN_GPU_BATCH_PAGES`` pages).

    Raises:
        PageCompError: an unknown ``backend``, or ``"triton"`` for host inputs with neither a
            usable GPU nor the interpreter.
    """
    if backend not in BACKENDS:
        raise PageCompError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not isinstance(device, torch.device):
        device = torch.device(device)
    if backend == "cpu":
        return CPU
    usable = gpu_status().usable
    if device.type == "cuda":
        if not usable:
            return CPU_SERVED
        return KERNELS if tensors is None or direct_launch_ok(tensors) else OP
    if backend == "auto" and not (usable and num_pages is not None
                                  and num_pages >= MIN_GPU_BATCH_PAGES):
        return CPU
    if interpreting():
        return INTERPRET
    if not usable:
        raise PageCompError(f"backend='triton' needs a usable GPU: {gpu_status().reason}")
    return UPLOAD


def select_backend(num_pages: int, device: torch.device | str) -> str:
    """Choose where a batch of ``num_pages`` pages held on ``device`` is compressed.

    Returns ``"triton"`` (GPU kernels; a host batch of at least ``MIN_GPU_BATCH_PAGES`` pages
    is copied to the GPU and back), ``"cpu-served"`` (CUDA tensor, but no usable GPU path:
    copied to the host, lz4 there, copied back) or ``"cpu"`` (lz4 on the CPU): the backend of
    :func:`route` for ``backend="auto"``.
    """
    check_int("num_pages", num_pages, 0)
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise PageCompError(f"device must be a torch.device or its name, got {device!r}") from None
    where = route("auto", num_pages, device)
    return where if where in (CPU, CPU_SERVED) else "triton"
