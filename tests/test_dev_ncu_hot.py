"""The ncu per-instruction reader (``bench/dev_ncu_hot.py``) on session 66's report of the
exponent encoder at 2252d0e (``bench/results/h200_session66/``): per warp 1,357 instructions,
16 values' ballots a bit of a 32-bin histogram (80 ``VOTE``), and a CSV without counts
refused."""

from __future__ import annotations

import os

import pytest

from bench.dev_ncu_hot import read_counts, summary

REPORT = os.path.join(os.path.dirname(__file__), "..", "bench", "results", "h200_session66",
                      "ncu_call1_2252d0e_encoder_sass.csv.gz")


def test_encoder_report_per_warp():
    s = summary(read_counts(REPORT))
    ops = dict(s["by_opcode"])
    assert s["warps"] == 16384 * 4  # 64 MiB of 4 KiB pages, 4 warps a page
    assert round(s["total"]) == 1357
    assert round(ops["VOTE"]) == 16 * 5  # 16 values a thread, a ballot for each of 5 bits
    assert round(ops["POPC"]) == 16
    assert 800 < s["alu"] < s["total"]
    ballots = [m for m in s["map"] if "VOTE" in m[4]]
    assert 500 < sum(m[2] for m in ballots) < 700  # the histogram: about half the kernel
    assert sum(m[2] for m in s["map"]) == pytest.approx(s["total"])


def test_refuses_a_csv_without_counts(tmp_path):
    p = tmp_path / "x.csv"
    p.write_text('"Address","Source","Instructions Executed"\n"0x0","LDC R1","0"\n')
    with pytest.raises(ValueError, match="no executed instructions"):
        read_counts(str(p))
