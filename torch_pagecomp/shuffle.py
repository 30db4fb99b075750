"""Reference bit-shuffle (torch, any device): the transform the kernels fuse.

See ``torch_pagecomp.format`` for the exact definition. Both functions take and return
``uint8 [N, P]`` tensors; ``element_size`` is 1 (identity), 2 or 4.
"""

from __future__ import annotations

import torch

from .format import check_element_size


def bitshuffle(pages: torch.Tensor, element_size: int) -> torch.Tensor:
    """Bit planes of each page: ``uint8 [N, P]`` -> ``uint8 [N, P]``."""
    check_element_size(element_size)
    if element_size == 1:
        return pages.clone()
    n_pages, page_size = pages.shape
    nbits = 8 * element_size
    groups = page_size // nbits  # n / 8 bytes per plane, n = P / E elements
    # bytes [N, groups, 8 elements, E bytes] -> bits [N, groups, 8, 8E] (bit b of element)
    b = pages.view(n_pages, groups, 8, element_size)
    shifts = torch.arange(8, device=pages.device, dtype=torch.uint8)
    bits = (b.unsqueeze(-1) >> shifts) & 1  # [N, groups, 8, E, 8]
    bits = bits.reshape(n_pages, groups, 8, nbits)  # bit index b = byte * 8 + bit
    weights = (1 << shifts).to(torch.int32)  # element t within the group -> bit t
    planes = (bits.to(torch.int32) * weights.view(1, 1, 8, 1)).sum(dim=2)  # [N, groups, 8E]
    return planes.transpose(1, 2).reshape(n_pages, page_size).to(torch.uint8)


def bitunshuffle(shuffled: torch.Tensor, element_size: int) -> torch.Tensor:
    """Inverse of :func:`bitshuffle`: ``uint8 [N, P]`` -> ``uint8 [N, P]``."""
    check_element_size(element_size)
    if element_size == 1:
        return shuffled.clone()
    n_pages, page_size = shuffled.shape
    nbits = 8 * element_size
    groups = page_size // nbits
    planes = shuffled.view(n_pages, nbits, groups).transpose(1, 2)  # [N, groups, 8E]
    shifts = torch.arange(8, device=shuffled.device, dtype=torch.uint8)
    bits = (planes.unsqueeze(2) >> shifts.view(1, 1, 8, 1)) & 1  # [N, groups, 8 elems, 8E]
    bits = bits.reshape(n_pages, groups, 8, element_size, 8).to(torch.int32)
    data = (bits * (1 << shifts).to(torch.int32)).sum(dim=-1)  # [N, groups, 8, E]
    return data.reshape(n_pages, page_size).to(torch.uint8)
