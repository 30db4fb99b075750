"""CPU reference codec on the ``lz4`` package: the format of ``torch_pagecomp.format``.

It serves CPU tensors, and CUDA tensors when no GPU path is usable (copy to host, compress,
copy back). ``decode_block`` is a readable pure-Python LZ4 block decoder that classifies
errors with the same status codes as the GPU decoder.
"""

from __future__ import annotations

import lz4.block
import numpy as np
import torch

from . import format as fmt
from .shuffle import bitshuffle, bitunshuffle


def compress_cpu(pages: torch.Tensor, element_size: int = 1):
    """``uint8 [N, P]`` (CPU) -> fixed-stride ``(payload [N, P], sizes int32 [N], kinds [N])``."""
    n, page_size = pages.shape
    payload = torch.zeros((n, page_size), dtype=torch.uint8)
    sizes = torch.empty(n, dtype=torch.int32)
    kinds = torch.empty(n, dtype=torch.uint8)
    if n == 0:
        return payload, sizes, kinds
    fill = (pages == pages[:, :1]).all(dim=1)
    shuffled = bitshuffle(pages, element_size) if element_size > 1 else pages
    src = shuffled.numpy()
    out = payload.numpy()
    limit = fmt.lz4_keep_limit(page_size)
    lz4_kind = fmt.KIND_LZ4 | (fmt.element_shift(element_size) << 4)
    fill_np = fill.numpy()
    size_np = sizes.numpy()
    kind_np = kinds.numpy()
    raw = pages.numpy()
    for i in range(n):
        if fill_np[i]:
            out[i, 0] = raw[i, 0]
            size_np[i], kind_np[i] = 1, fmt.KIND_FILL
            continue
        block = lz4.block.compress(src[i].tobytes(), store_size=False)
        if len(block) <= limit:
            out[i, : len(block)] = np.frombuffer(block, dtype=np.uint8)
            size_np[i], kind_np[i] = len(block), lz4_kind
        else:
            out[i] = raw[i]
            size_np[i], kind_np[i] = page_size, fmt.KIND_RAW
    return payload, sizes, kinds


def decode_block(block: bytes, page_size: int) -> tuple[bytes | None, int]:
    """Decode one LZ4 block into exactly ``page_size`` bytes, or say why not.

    Returns ``(data, STATUS_OK)`` or ``(None, status)``. Reads nothing past ``block``, writes
    nothing past ``page_size`` and ends: every step consumes at least one input byte.
    """
    out = bytearray()
    ip, end = 0, len(block)
    while True:
        if ip >= end:
            return None, fmt.STATUS_TRUNCATED
        token = block[ip]
        ip += 1
        lit = token >> 4
        if lit == 15:
            while True:
                if ip >= end:
                    return None, fmt.STATUS_TRUNCATED
                b = block[ip]
                ip += 1
                lit += b
                if b != 255:
                    break
        if ip + lit > end:
            return None, fmt.STATUS_TRUNCATED
        if len(out) + lit > page_size:
            return None, fmt.STATUS_OVERFLOW
        out += block[ip : ip + lit]
        ip += lit
        if ip == end:  # the last sequence holds literals only
            break
        if ip + 2 > end:
            return None, fmt.STATUS_TRUNCATED
        offset = block[ip] | (block[ip + 1] << 8)
        ip += 2
        if offset == 0 or offset > len(out):
            return None, fmt.STATUS_BAD_OFFSET
        mlen = (token & 15) + 4
        if token & 15 == 15:
            while True:
                if ip >= end:
                    return None, fmt.STATUS_TRUNCATED
                b = block[ip]
                ip += 1
                mlen += b
                if b != 255:
                    break
        if len(out) + mlen > page_size:
            return None, fmt.STATUS_OVERFLOW
        start = len(out) - offset
        for k in range(mlen):  # byte by byte: overlapping copies repeat the pattern
            out.append(out[start + k])
    if len(out) != page_size:
        return None, fmt.STATUS_SHORT
    return bytes(out), fmt.STATUS_OK


def _decode_lz4(block: bytes, page_size: int) -> tuple[bytes | None, int]:
    """liblz4 first (fast); where it refuses, ``decode_block`` decides, like the GPU decoder.

    liblz4 is stricter than the format at the end of a block (e.g. a match ending in the last 5
    bytes), so a block it refuses may still decode; ``decode_block`` gives the GPU decoder's
    verdict and bytes. One known difference remains: liblz4 accepts a match offset of 0 (which
    the format and the GPU decoder reject) and leaves those bytes unspecified. Corruption that
    keeps a block well-formed is never detectable: LZ4 blocks carry no checksum.
    """
    try:
        data = lz4.block.decompress(block, uncompressed_size=page_size)
    except Exception:  # lz4 says only "corrupt"
        return decode_block(block, page_size)
    if len(data) != page_size:
        return None, fmt.STATUS_SHORT
    return data, fmt.STATUS_OK


def decompress_cpu(payload, offsets, sizes, kinds, page_size: int):
    """Decode pages on the CPU.

    Args:
        payload: ``uint8 [T]`` (a fixed-stride payload viewed 1-D, or a packed one).
        offsets: ``int64 [N]`` start of each page in ``payload``.
        sizes: ``int32 [N]``; kinds: ``uint8 [N]``.
    Returns:
        ``(pages uint8 [N, P], status int32 [N])``; a failed page's row is zero-filled.
    """
    n = sizes.shape[0]
    pages = torch.zeros((n, page_size), dtype=torch.uint8)
    status = torch.zeros(n, dtype=torch.int32)
    buf = payload.numpy()
    out = pages.numpy()
    st = status.numpy()
    total = buf.shape[0]
    shuffled_rows: dict[int, list[int]] = {2: [], 4: []}
    for i, (off, size, kind) in enumerate(zip(offsets.tolist(), sizes.tolist(), kinds.tolist())):
        codec, shift = kind & 15, kind >> 4
        if codec not in fmt.KIND_NAMES or shift > 2 or (shift and codec != fmt.KIND_LZ4):
            st[i] = fmt.STATUS_BAD_KIND
            continue
        if off < 0 or size < 1 or off + size > total:
            st[i] = fmt.STATUS_BAD_SIZE
            continue
        if codec == fmt.KIND_FILL:
            if size != 1:
                st[i] = fmt.STATUS_BAD_SIZE
            else:
                out[i] = buf[off]
        elif codec == fmt.KIND_RAW:
            if size != page_size:
                st[i] = fmt.STATUS_BAD_SIZE
            else:
                out[i] = buf[off : off + size]
        else:
            data, st[i] = _decode_lz4(buf[off : off + size].tobytes(), page_size)
            if data is not None:
                out[i] = np.frombuffer(data, dtype=np.uint8)
                if shift:
                    shuffled_rows[1 << shift].append(i)
    for element_size, rows in shuffled_rows.items():
        if rows:
            idx = torch.tensor(rows, dtype=torch.int64)
            pages[idx] = bitunshuffle(pages[idx], element_size)
    return pages, status


def pack_cpu(payload: torch.Tensor, sizes: torch.Tensor):
    """Fixed-stride ``payload [N, P]`` -> ``(packed uint8 [N * P], offsets int64 [N + 1])``.

    Sizes are clamped to ``[0, P]``. The length is the upper bound (so that the GPU version
    needs no host synchronisation); bytes past ``offsets[N]`` are zero.
    """
    n, page_size = payload.shape
    clamped = sizes.clamp(0, page_size).to(torch.int64)
    offsets = torch.zeros(n + 1, dtype=torch.int64)
    torch.cumsum(clamped, dim=0, out=offsets[1:])
    packed = torch.zeros(n * page_size, dtype=torch.uint8)
    src, dst = payload.numpy(), packed.numpy()
    for i, (o, s) in enumerate(zip(offsets[:-1].tolist(), clamped.tolist())):
        dst[o : o + s] = src[i, :s]
    return packed, offsets
