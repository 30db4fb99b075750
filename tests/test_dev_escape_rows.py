"""The many-escapes probe (``bench/dev_escape_rows.py``): it counts a page as taking the
decoder's many-escapes path exactly when a row of 8 values has three or more escapes."""

from __future__ import annotations

import torch

from bench.dev_escape_rows import escape_rows


def _page(gen: torch.Generator, rows: dict[int, int]) -> torch.Tensor:
    """A 4 KiB bf16 page: exponents 100-106 (the table) but ``rows[g]`` escapes in row ``g``
    (exponents 150 and up, each a few times at most)."""
    e = 100 + torch.randint(0, 7, (2048,), generator=gen, dtype=torch.int32)
    for g, k in rows.items():
        e[8 * g:8 * g + k] = 150 + torch.randint(0, 100, (k,), generator=gen, dtype=torch.int32)
    low = torch.randint(0, 1 << 7, (2048,), generator=gen, dtype=torch.int32)
    return ((e << 7) | low).to(torch.int16).view(torch.uint8)


def test_escape_rows_counts_rows_of_three(gen):
    pages = torch.stack([_page(gen, {}), _page(gen, {0: 2, 9: 2, 200: 1}),
                         _page(gen, {5: 3}), _page(gen, {1: 1, 7: 8})])
    share, rate, many = escape_rows(pages)
    assert share == 1.0  # all EXP
    assert abs(rate - (0 + 5 + 3 + 9) / (4 * 2048)) < 1e-9
    assert many == 0.5  # the last two pages
