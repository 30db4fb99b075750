"""The transformers generation benchmark at toy sizes on the CPU: every variant runs in its own
child, the compressed cache seals and compresses blocks, and greedy tokens match
``DynamicCache``'s. (``DynamicCache(offloading=True)`` needs CUDA in transformers 5.24: on the
CPU its row is a skip that names the error, not a failure.)"""

from __future__ import annotations

import json

import pytest

from bench import hf_generate  # imports transformers only inside its functions

pytest.importorskip("transformers")


def test_tiny_cpu_generation_bench(tmp_path):
    out = tmp_path / "g.json"
    assert hf_generate.main(["--tiny", "--device", "cpu", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    for key in ("device", "commit", "date", "torch", "transformers", "command", "rows"):
        assert key in doc, key
    assert doc["device"] == "cpu"
    rows = {r["variant"]: r for r in doc["rows"]}
    assert list(rows) == list(hf_generate.VARIANTS)
    assert not [r for r in doc["rows"] if "error" in r], doc["rows"]

    off = rows["dynamic_offloaded"]
    ran = [rows["dynamic"], rows["compressed"]]
    if "skipped" in off:  # transformers' offloading is CUDA-only; the row says why
        assert "offloading=True" in off["skipped"] and "cpu" in off["skipped"]
    else:
        ran.append(off)
    for r in ran:
        assert r["exit_code"] == 0
        assert r["tokens_identical_to_dynamic"] is True, r
        assert "tokens" not in r and len(r["tokens_hash"]) == 16
        assert r["new_tokens"] == r["new"] == 6 and r["prompt"] == 40
        assert r["cache_kwarg"] in ("cache", "past_key_values")
        assert r["total_s"] > r["prefill_s"] > 0 and r["decode_tokens_per_s"] > 0
        assert r["kv_gib"] > 0 and r["threads_after_close"] == []
    assert len({r["tokens_hash"] for r in ran}) == 1
    assert rows["dynamic"]["host_gib"] == 0

    comp = rows["compressed"]
    st = comp["cache_stats"]
    tokens = comp["prompt"] + comp["new"] - 1  # the last generated token is never fed back
    assert comp["block_tokens"] == 16
    assert st["compressed_layers"] == 2 and st["blocks"] == 2 * (tokens // 16) > 0
    assert st["host_bytes"] > 0 and comp["host_gib"] > 0
    assert st["compressed_bytes"] == st["blocks"] * 2 * 2 * 16 * 16 * 4  # K+V, fp32 blocks
    assert comp["compressor"]["cpu"]["offloads"] == st["blocks"]  # each block once
    assert st["restored_on_use"] > 0

    md = (tmp_path / "g.md").read_text()
    assert "| compressed |" in md and "| dynamic |" in md
    assert md.strip() == hf_generate.table(doc)
