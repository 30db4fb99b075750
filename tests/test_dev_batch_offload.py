"""The batched-offload probe (``bench/dev_batch_offload.py``, issue #21) at toy sizes: both ways
give every byte back, and the table has a row per case, so a GPU run of it measures what it
says."""

from __future__ import annotations

import pytest

probe = pytest.importorskip("bench.dev_batch_offload")


def test_probe_round_trips_both_ways():
    lines = probe.main(["--mib", "0.02", "--batch", "1,3", "--rounds", "1"])
    rows = [line for line in lines[2:] if line.startswith("| ")]
    assert len(rows) == 2
    assert all(row.rstrip(" |").endswith("True") for row in rows), rows
