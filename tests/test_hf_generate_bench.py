"""The transformers generation benchmark at toy sizes on the CPU: every variant runs in its own
child, the compressed cache seals and compresses blocks, greedy tokens match ``DynamicCache``'s
and the diagnostics (ids, logit hashes and margins, ``--check-kv``) come back.
(``DynamicCache(offloading=True)`` needs CUDA in transformers 4.57-5.24: on the CPU its row is a
skip that names the error, not a failure.)"""

from __future__ import annotations

import json

import pytest

from bench import hf_generate  # imports transformers only inside its functions

pytest.importorskip("transformers", minversion="4.57")  # the integration's floor


@pytest.mark.slow  # three child processes (~35 s); the cache itself is tested in test_integrations
def test_tiny_cpu_generation_bench(tmp_path):
    out = tmp_path / "g.json"
    assert hf_generate.main(["--tiny", "--device", "cpu", "--check-kv", "2", "--out",
                             str(out)]) == 0
    doc = json.loads(out.read_text())
    for key in ("device", "commit", "date", "torch", "transformers", "command", "rows"):
        assert key in doc, key
    assert doc["device"] == "cpu"
    rows = {r["variant"]: r for r in doc["rows"]}
    assert list(rows) == list(hf_generate.VARIANTS)
    assert not [r for r in doc["rows"] if "error" in r], doc["rows"]

    off = rows["dynamic_offloaded"]
    ran = [rows["dynamic"], rows["dynamic_repeat"], rows["compressed"], rows["compressed_lz4"]]
    if "skipped" in off:  # transformers' offloading is CUDA-only; the row says why
        assert "offloading=True" in off["skipped"] and "cpu" in off["skipped"]
    else:
        ran.append(off)
    for r in ran:
        assert r["exit_code"] == 0
        assert r["tokens_identical_to_dynamic"] is True, r
        assert len(r["tokens_hash"]) == 16 and len(r["tokens"]) == r["batch"] == 1
        assert len(r["tokens"][0]) == len(r["logits_hash"]) == len(r["top2_margin"]) == 6
        assert r["first_logits_diff_step"] is None and "divergence" not in r
        assert r["weights_identical_to_dynamic"] is True
        if r["variant"] != "dynamic":  # fed the same tokens, everything bit-identical
            check = r["kv_check"]
            assert check["steps"] == 2
            assert all(check[k] is None for k in ("kv", "attn", "logits", "argmax")), check
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
    assert st["sealed"] == st["blocks"]  # each block once
    assert st["restored_on_use"] > 0 and comp["host_pool_gib"] > 0
    assert comp["device_metadata_bytes"] == 0  # counted on a GPU only (on the CPU: none)
    assert comp["device_metadata_split"] == {"slices": 0, "group_copies": 0}
    assert comp["device_metadata_first_token"] == {"slices": 0, "group_copies": 0}

    md = (tmp_path / "g.md").read_text()
    assert "| compressed |" in md and "| dynamic |" in md
    assert md.strip() == hf_generate.table(doc)


def test_divergence_report():
    """A row whose tokens part from ``dynamic``'s: the first step, ``dynamic``'s margin there,
    the first step whose logits differ."""
    ref = {"variant": "dynamic", "tokens": [[1, 2, 3, 4], [5, 6, 7, 8]],
           "logits_hash": ["a", "b", "c", "d"], "top2_margin": [[1.0, 2.0], [0.5, 0.0],
                                                                [0.25, 3.0], [1.0, 1.0]],
           "weights_hash": "w", "input_hash": "i"}
    other = dict(ref, variant="compressed", tokens=[[1, 2, 9, 9], [5, 9, 7, 8]],
                 logits_hash=["a", "x", "y", "z"])
    doc = hf_generate._finish([ref, other], {})
    same, diff = doc["rows"]
    assert same["tokens_identical_to_dynamic"] and same["first_logits_diff_step"] is None
    assert "divergence" not in same and same["tokens"] == ref["tokens"]
    assert diff["tokens_identical_to_dynamic"] is False and diff["first_logits_diff_step"] == 1
    div = diff["divergence"]
    assert div["first_step"] == 1 and div["rows_first_differing"] == {0: 2, 1: 1}
    assert div["dynamic_margin_at_first_step"] == 0.0 and div["dynamic_exact_ties"] == 1
    assert "first token diff" in hf_generate.table(
        {"rows": [dict(r, layers=1, batch=2, prompt=3, new=4, prefill_s=0.1, total_s=0.2)
                  for r in doc["rows"]]})


def test_metadata_split_counts_each_allocation_once():
    """``_metadata_split``: the blocks' own metadata (views of one allocation per slice) and
    the layers' concatenated copies, each device allocation counted once, in its part."""
    from types import SimpleNamespace as NS

    class Storage:
        def __init__(self, ptr, nbytes):
            self.ptr, self.n = ptr, nbytes

        def data_ptr(self):
            return self.ptr

        def nbytes(self):
            return self.n

    class T:  # a device tensor's view of an allocation
        is_cuda = True

        def __init__(self, storage):
            self.storage = storage

        def untyped_storage(self):
            return self.storage

    a, b, c, d = Storage(1, 100), Storage(2, 60), Storage(3, 40), Storage(4, 8)
    sl1 = NS(rel=T(a), sizes=T(a), kinds=T(a))  # one block: rel | desc | sizes | kinds
    sl2 = NS(rel=T(b), sizes=T(b), kinds=T(b))
    host = NS(rel=NS(is_cuda=False), sizes=None, kinds=None)
    groups = [NS(storeds=[NS(slices=[sl1, sl2]), NS(slices=[sl1, host])],
                 meta=(T(c), T(d), T(d))),
              NS(storeds=[], meta=None)]
    cache = NS(layers=[NS(_group=g) for g in groups] + [NS()])
    assert hf_generate._metadata_split(cache) == {"slices": 160, "group_copies": 48}
    assert hf_generate._metadata_bytes(cache) == 208


def test_peak_origins_replays_the_trace_to_its_peak():
    """``peak_origins``: what is allocated at the trace's highest point, by origin (the package's
    innermost frame first, then transformers', then any Python frame), freed blocks excluded,
    and the peak counted from ``base``."""
    import random

    pkg = [{"filename": "/x/site-packages/torch_pagecomp/offload/_paged.py", "line": 7,
            "name": "_store_slice"}, {"filename": "/x/transformers/cache_utils.py", "line": 3,
                                      "name": "update"}]
    hf = [{"filename": "/x/transformers/models/llama.py", "line": 9, "name": "forward"},
          {"filename": "/y/run.py", "line": 1, "name": "main"}]
    other = [{"filename": "<string>", "line": 0, "name": "?"}, {"filename": "/y/run.py",
                                                                "line": 2, "name": "main"}]
    a, b, c = random.sample([64, 128, 512, 2048], 3)
    trace = [
        {"action": "alloc", "addr": 1, "size": a, "frames": pkg},
        {"action": "alloc", "addr": 2, "size": 1000, "frames": hf},
        {"action": "free_requested", "addr": 2, "size": 1000},
        {"action": "free_completed", "addr": 2, "size": 1000},
        {"action": "alloc", "addr": 3, "size": b, "frames": hf},
        {"action": "alloc", "addr": 4, "size": 5000, "frames": other},  # the peak
        {"action": "free_requested", "addr": 4, "size": 5000},
        {"action": "alloc", "addr": 5, "size": c, "frames": pkg},  # after the peak
    ]
    got = hf_generate.peak_origins(trace, base=10)
    assert got["peak_bytes"] == 10 + a + b + 5000 and got["base"] == 10
    assert dict(got["origins"]) == {
        "torch_pagecomp/offload/_paged.py:7 _store_slice": a,
        "transformers/models/llama.py:9 forward": b,
        "/y/run.py:2 main": 5000,
    }
    assert got["origins"][0] == ["/y/run.py:2 main", 5000]  # largest first
