"""Format constants the kernels compile in: page kinds, decode statuses, page-size bounds.

This module imports nothing from the package, so the kernels depend on nothing above them;
``torch_pagecomp.format`` re-exports these names and documents the format.
"""

from __future__ import annotations

MIN_PAGE_SIZE = 4096
MAX_PAGE_SIZE = 65536
ELEMENT_SIZES = (1, 2, 4)

KIND_RAW = 0
KIND_LZ4 = 1
KIND_FILL = 2
# An LZ4 page of bit-shuffled elements: ``KIND_LZ4 | element_shift(element_size) << 4``.
KIND_LZ4_SHUFFLED_2 = 0x11  # 2-byte elements
KIND_LZ4_SHUFFLED_4 = 0x21  # 4-byte elements
# An exponent-coded page of 16-bit floats (``torch_pagecomp.format``): ``KIND_EXP | layout << 4``.
KIND_EXP = 3
EXP_BF16 = 1  # layout: bfloat16 (8-bit exponent at bits 7..14)
EXP_FP16 = 2  # layout: float16 (5-bit exponent at bits 10..14)
KIND_EXP_BF16 = KIND_EXP | EXP_BF16 << 4  # 0x13
KIND_EXP_FP16 = KIND_EXP | EXP_FP16 << 4  # 0x23
EXP_TABLE = 7  # exponents in an exponent page's table; code EXP_TABLE escapes
# The table counts the exponents of one row of 8 values in EXP_SAMPLE: values 32j .. 32j + 7
EXP_SAMPLE = 4

# Per-page decode status (int32), written by every decoder.
STATUS_OK = 0
STATUS_BAD_KIND = 1  # unknown kind nibble, a shuffle on a non-LZ4 page, a bad exponent layout,
# or a kind the decoder called does not decode (exponent pages in the LZ4 decoder and back)
STATUS_BAD_SIZE = 2  # size out of range for the kind, or past the end of the payload
STATUS_TRUNCATED = 3  # the LZ4 block ends inside a sequence
STATUS_BAD_OFFSET = 4  # match offset 0, or reaching before the start of the page
STATUS_OVERFLOW = 5  # literals or a match run past the end of the page
STATUS_SHORT = 6  # the block decodes to fewer bytes than the page holds
STATUS_CHECKSUM = 7  # decoded, but to other bytes than were compressed (page checksum)

# Page checksum (``torch_pagecomp.format``): xxHash32 of the page, seed 0; the primes a page of
# whole 16-byte stripes uses (xxHash32's PRIME4 and PRIME5 only mix bytes after the last stripe).
XXH_PRIME1 = 0x9E3779B1
XXH_PRIME2 = 0x85EBCA77
XXH_PRIME3 = 0xC2B2AE3D


def element_shift(element_size: int) -> int:
    """``log2(element_size)``, the value stored in the high nibble of ``kinds``."""
    return {1: 0, 2: 1, 4: 2}[element_size]


def exp_fixed_bytes(page_size: int, layout: int) -> int:
    """Bytes of an exponent page before its escapes (table, codes, the rest of each value):
    ``7 + 3n/8 + n`` (bf16) or ``7 + 6n/8 + n`` (fp16) for ``n = page_size / 2`` values."""
    n = page_size // 2
    return EXP_TABLE + (3 * n // 8) * (1 if layout == EXP_BF16 else 2) + n


def valid_page_size(page_size: object) -> bool:
    """Whether ``page_size`` is a power of two in ``[MIN_PAGE_SIZE, MAX_PAGE_SIZE]``."""
    return (
        isinstance(page_size, int)
        and MIN_PAGE_SIZE <= page_size <= MAX_PAGE_SIZE
        and page_size & (page_size - 1) == 0
    )
