"""``bench.dev_step_profile.timeline`` reads a step's timeline from a profiler trace's events:
when the host reaches the backward, the compute stream's busy and idle time (idle split by
whether the host issued the next kernel late), when the first restore copy was issued and
when it ran, and when the bytes the forward sent to the host were all there."""

from bench.dev_step_profile import timeline


def _op(name, ts, dur=10, cat="cpu_op", corr=None):
    e = {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat}
    if corr is not None:
        e["args"] = {"correlation": corr}
    return e


def test_timeline_of_a_step():
    events = [
        _op("aten::zero_", 1000),  # the step's first host op: t = 0
        _op("cudaLaunchKernel", 2000, cat="cuda_runtime", corr=1),
        _op("_pack_slice_kernel", 2500, dur=3000, cat="kernel", corr=1),  # ends at 5.5 ms
        _op("cudaMemcpyAsync", 3000, cat="cuda_runtime", corr=2),
        _op("Memcpy DtoH (Device -> Pinned)", 6000, dur=1500, cat="gpu_memcpy", corr=2),
        _op("autograd::engine::evaluate_function: MmBackward0", 8000),
        _op("cudaMemcpyAsync", 9000, cat="cuda_runtime", corr=3),
        _op("Memcpy HtoD (Pinned -> Device)", 12000, dur=500, cat="gpu_memcpy", corr=3),
        _op("cudaLaunchKernel", 9500, cat="cuda_runtime", corr=4),
        _op("_pack_slice_kernel", 13000, dur=100, cat="kernel", corr=4),  # after the backward
        _op("an instant event, not a span", 0) | {"ph": "i"},
    ]
    events += [_op("cudaLaunchKernel", 2100, cat="cuda_runtime", corr=5),
               _op("_exp_encode_kernel", 2200, dur=200, cat="kernel", corr=5),
               _op("cudaLaunchKernel", 9600, cat="cuda_runtime", corr=6),  # in the backward
               _op("_lz4_compress_kernel", 12500, dur=400, cat="kernel", corr=6)]
    rows = dict([c.strip() for c in line.strip("|").split("|")] for line in timeline(events)[2:])
    assert rows == {"host reaches the backward": "7.0",
                    # the four kernels (one stream): 2.2-2.4, 2.5-5.5, 12.5-12.9, 13.0-13.1 ms
                    # from the trace's start, 3.7 ms busy over 10.9; idle 0.1 ms before the
                    # pack (issued at 2.0: a device wait), 7.0 before the LZ4 kernel, of which
                    # 4.1 until the host issued it (at 9.6) and 2.9 after, 0.1 before the last
                    "compute stream, both profiled steps: span / busy (kernels)":
                        "10.9 / 3.7 (4)",
                    "compute stream idle: host late / device waits": "4.1 / 3.1",
                    "first restore copy issued / run": "8.0 / 11.0",
                    "the forward's bytes all on the host": "6.5",
                    "outbound work (pack kernels or copies) starts": "1.5",
                    # 3.0 + 1.5 ms busy; idle from 5.5 (the pack's end) to 6.0 (the copy)
                    "outbound work busy / idle between its pieces": "4.5 / 0.5",
                    "compress kernels of the forward, GPU time": "0.2"}


def test_timeline_without_a_backward_or_host_ops():
    assert timeline([]) == []
    assert timeline([_op("aten::mm", 0)]) == []
