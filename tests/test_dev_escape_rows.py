"""The many-escapes probe (``bench/dev_escape_rows.py``): it counts a page as taking the
decoder's many-escapes path exactly when a row of 8 values has three or more escapes."""

from __future__ import annotations

import torch
from pages import escape_rows_page

from bench.dev_escape_rows import escape_rows


def test_escape_rows_counts_rows_of_three(gen):
    rows = [{}, {0: [0, 1], 9: [0, 1], 200: [0]}, {5: [0, 1, 2]}, {1: [0], 7: list(range(8))}]
    pages = torch.stack([escape_rows_page(gen, 2048, r) for r in rows])
    share, rate, many = escape_rows(pages)
    assert share == 1.0  # all EXP
    assert abs(rate - (0 + 5 + 3 + 9) / (4 * 2048)) < 1e-9
    assert many == 0.5  # the last two pages
