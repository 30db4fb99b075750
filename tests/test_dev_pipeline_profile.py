"""The ring profile's reader (``bench/dev_pipeline_profile.py``) on a made-up Chrome trace: GPU
work summed by name, largest first; the compute stream (the stream with the most kernels)
listed kernel by kernel with each launch's issue time beside its start, both from the first
launch, and nothing of the other streams there."""

from __future__ import annotations

from bench.dev_pipeline_profile import report


def _launch(corr: int, ts: float) -> dict:
    return {"ph": "X", "cat": "cuda_runtime", "name": "cuLaunchKernel", "ts": ts, "dur": 4,
            "args": {"correlation": corr}}


def _gpu(corr: int, name: str, ts: float, dur: float, stream: int, cat: str = "kernel"
         ) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur,
            "args": {"correlation": corr, "stream": stream}}


def test_report_sums_by_name_and_lists_the_compute_stream():
    events = [
        _launch(1, 1000.0), _gpu(1, "_exp_encode_kernel", 1040.0, 88.0, 7),
        _launch(2, 1100.0), _gpu(2, "page_offsets_kernel", 1130.0, 24.0, 7),
        _launch(3, 1150.0), _gpu(3, "pack_pages_kernel", 1160.0, 51.0, 7),
        _launch(4, 1500.0), _gpu(4, "_exp_encode_kernel", 1540.0, 90.0, 7),
        _gpu(5, "Memcpy DtoH (Device -> Pinned)", 1300.0, 800.0, 9, "gpu_memcpy"),
        _gpu(6, "publish_kernel", 1220.0, 1.0, 11),  # another stream: not listed
        {"ph": "X", "cat": "cpu_op", "name": "aten::empty", "ts": 990.0, "dur": 3, "args": {}},
    ]
    lines = report(events, batches=1)
    sums = lines[2:lines.index("")]
    assert sums[0] == "| Memcpy DtoH (Device -> Pinned) | 1 | 0.80 | 800.0 |"
    assert sums[1] == "| _exp_encode_kernel | 2 | 0.18 | 89.0 |"
    assert len(sums) == 5
    rows = lines[lines.index("") + 3:]
    assert rows == ["| _exp_encode_kernel | 0.000 | 0.040 | 88.0 |",
                    "| page_offsets_kernel | 0.100 | 0.130 | 24.0 |",
                    "| pack_pages_kernel | 0.150 | 0.160 | 51.0 |",
                    "| _exp_encode_kernel | 0.500 | 0.540 | 90.0 |"]


def test_report_without_kernels_gives_the_sums_alone():
    lines = report([_gpu(1, "Memcpy HtoD", 0.0, 10.0, 3, "gpu_memcpy")], batches=2)
    assert lines[-1] == "| Memcpy HtoD | 1 | 0.01 | 10.0 |" and "" not in lines
