"""Which LZ4 blocks hold a match offset of 0: the one rule of the format that liblz4 does not
enforce (it copies zeros instead), found for many blocks at once with numpy.

The blocks' sequence headers are walked in lockstep: one step moves every block from one token
to the next with a handful of numpy calls over all blocks, so the cost is a few numpy element
operations per sequence instead of a pass of a Python loop per sequence. A token with a length
extension byte (about one in six) parks its block until the next fix-up step, which reads the
extensions of all parked blocks together. When few blocks are left, a Python loop finishes
them (a numpy step costs about the same for one block as for a thousand).
"""

from __future__ import annotations

import numpy as np

_TOKENS = np.arange(256)
_LIT = _TOKENS >> 4
# Bytes from a token to the next one when neither length has an extension (token, literals,
# offset); 0 parks the block: the fix-up step reads the extension bytes.
_STEP = np.where((_LIT < 15) & ((_TOKENS & 15) < 15), 3 + _LIT, 0).astype(np.int64)
_PAD = 0x01  # a token of no literals and offset 0x0101: a finished block steps 3 bytes a step
_FIX_EVERY = 4  # main steps between fix-up steps (and between dropping finished blocks)
_PYTHON_TAIL = 64  # at most this many blocks left: walked one by one in Python
# Pad bytes after each block: a step from inside a block lands at most 17 bytes past its end,
# then steps 3 through the pad until the block is dropped (reads stay in the block's own gap).
_GAP = 24 + 3 * _FIX_EVERY


def _read_ext(cb: np.ndarray, pos: np.ndarray, stop: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Length extensions starting at ``pos``: 255s, then one byte below 255. Returns ``(sum,
    position after them)``; a run of 255s is cut at ``stop`` (reads stay inside ``cb``)."""
    total = cb.take(pos, mode="clip").astype(np.int64)
    pos = pos + 1
    more = np.flatnonzero(total == 255)
    while more.shape[0]:  # rare: lengths of 270 or more
        b = cb.take(pos[more], mode="clip").astype(np.int64)
        total[more] += b
        pos[more] += 1
        more = more[(b == 255) & (pos[more] < stop[more])]
    return total, pos


def _fix_up(cb, zz, ip, tok, end, bad, idx) -> np.ndarray:
    """One sequence for blocks parked at a token with a length extension: marks ``bad[idx]``
    where its offset is 0; returns the next token's position (``end + 2`` after the last)."""
    t = tok.astype(np.int64)
    lit = t >> 4
    pos = ip + 1
    ext = np.flatnonzero(lit == 15)
    if ext.shape[0]:
        add, pos[ext] = _read_ext(cb, pos[ext], end[ext])
        lit[ext] += add
    q = pos + lit  # the offset field, or the block's end after its last literals
    more = q < end
    bad[idx[more & zz.take(q + 2, mode="clip")]] = True
    pos = q + 2
    ext = np.flatnonzero(more & ((t & 15) == 15))
    if ext.shape[0]:
        pos[ext] = _read_ext(cb, pos[ext], end[ext])[1]
    return np.minimum(pos, end + 2)


def _walk_one(cb: memoryview, ip: int, end: int) -> bool:
    """The walk of one block from its token at ``ip`` to ``end``: whether an offset is 0."""
    while ip < end:
        token = cb[ip]
        ip += 1
        lit = token >> 4
        if lit == 15:
            while ip < end:
                b = cb[ip]
                ip += 1
                lit += b
                if b != 255:
                    break
        ip += lit
        if ip + 2 > end:
            return False
        if cb[ip] == 0 and cb[ip + 1] == 0:
            return True
        ip += 2
        if token & 15 == 15:
            while ip < end:
                ip += 1
                if cb[ip - 1] != 255:
                    break
    return False


def zero_offset_blocks(buf: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """``bool [M]``: which blocks ``buf[starts[k]:ends[k]]`` hold a match offset of 0.

    For blocks that liblz4 decoded (every sequence inside the block, the last one literals
    only), for which the answer is exact. Reads stay inside a copy of the blocks whatever their
    bytes; on blocks liblz4 refuses the answer means nothing.

    Args:
        buf: ``uint8 [T]``; starts, ends: ``int64 [M]`` with ``0 <= starts <= ends <= T``.
    """
    m = starts.shape[0]
    bad = np.zeros(m, dtype=bool)
    if m == 0:
        return bad
    lens = (ends - starts).astype(np.int64)
    first = np.zeros(m + 1, dtype=np.int64)  # where each block starts in `cb`
    np.cumsum(lens + _GAP, out=first[1:])
    pad = np.full(_GAP, _PAD, dtype=np.uint8)
    parts = []
    for s, e in zip(starts.tolist(), ends.tolist()):
        parts += (buf[s:e], pad)
    cb = np.concatenate(parts + [pad])
    # zz[x]: bytes x - 2 and x - 1 are both zero (the offset field of a sequence whose next
    # token is at x); the pad bytes are never zero, so no pair straddles two blocks
    zz = np.zeros(cb.shape[0] + 2, dtype=bool)
    np.equal(cb[:-1] | cb[1:], 0, out=zz[2:-1])
    ip, end, idx = first[:-1].copy(), first[:-1] + lens, np.arange(m)
    while idx.shape[0] > _PYTHON_TAIL:
        for _ in range(_FIX_EVERY):
            tok = cb.take(ip)
            step = _STEP.take(tok)
            ip += step
            hit = zz.take(ip)
            if hit.any():  # a parked block did not move: its ip - 2 is no offset field
                bad[idx[hit & (step != 0)]] = True
        park = np.flatnonzero(step == 0)  # parked at an extension token (see _STEP)
        if park.shape[0]:
            ip[park] = _fix_up(cb, zz, ip[park], tok[park], end[park], bad, idx[park])
        live = (ip < end) & ~bad[idx]
        if not live.all():
            idx, ip, end = idx[live], ip[live], end[live]
    # the last few blocks one at a time: a numpy step costs the same for 1 block as for 1000
    data = memoryview(cb)
    for k, p, e in zip(idx.tolist(), ip.tolist(), end.tolist()):
        bad[k] = _walk_one(data, p, e)
    return bad
