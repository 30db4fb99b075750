"""How every launcher starts its kernel: traced (through ``torch.library.wrap_triton``) or direct.

Inside a ``triton_op`` (``torch.ops.pagecomp.*``) a kernel goes through ``wrap_triton`` so that
``torch.compile`` and ``make_fx`` can trace it; in eager mode the op turns that off and the kernel
launches directly. An eager caller that calls a launcher itself (the pipeline, on its own streams)
passes ``traced=False``: a ``wrap_triton`` kernel called outside an op goes through PyTorch's
higher-order-op dispatch, measured at ~200 us of host time per launch on an H200 host.
"""

from __future__ import annotations

import os

import torch
from torch.library import wrap_triton


def interpreting() -> bool:
    """Whether Triton runs kernels on the CPU (``TRITON_INTERPRET=1``): no inline PTX, and
    launchers pick settings that cost the interpreter fewer operations. Read at each launch,
    never at import, so import order changes nothing."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def launch(kernel, grid: tuple[int, ...], device: torch.device, args: tuple, meta: dict,
           traced: bool = True) -> None:
    """Launch ``kernel[grid](*args, **meta)`` on ``device``'s current stream."""
    fn = wrap_triton(kernel)[grid] if traced else kernel[grid]
    if (device.type == "cuda" and not torch.compiler.is_compiling()
            and device.index is not None and device.index != torch.cuda.current_device()):
        with torch.cuda.device(device):  # Triton launches on the current device's stream
            fn(*args, **meta)
    else:  # on the current device already (the common case: no switch), or compiled code,
        fn(*args, **meta)  # which sets the device itself
