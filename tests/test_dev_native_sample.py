"""``bench.dev_native_sample.report`` sums py-spy's raw samples per thread: the main thread's
inside the timed steps, a thread that ran the unpack hooks named the backward's; per thread
the time in package frames, Python functions by inclusive time (once per sample however
often a function recurs), package functions by exclusive time, native frames and CUDA calls
where there are any, in ms a step given the samples a step."""

from bench.dev_native_sample import report

MAIN = 'thread (0x1) "MainThread"'
STEPS = "_sampled_steps (bench/dev_native_sample.py:30)"
PACK = "_pack (torch_pagecomp/offload/_hooks.py:420)"


def _table(text: str, thread: str, title: str) -> dict:
    """``{name: time}`` of one table of one thread's section of ``text``."""
    part = text.split(f"## thread {thread}")[1].split("## thread")[0]
    body = part.split(f"### {title}\n")[1].split("###")[0]
    rows = [line.strip("|").rsplit("|", 1) for line in body.splitlines()[2:] if line]
    return {name.strip(): float(t) for name, t in rows}


def test_report_sums_by_thread_and_function(tmp_path):
    raw = tmp_path / "spy.txt"
    raw.write_text("\n".join([
        # the main thread in the steps: 4 samples in the pack hook (two lines of it, one
        # sample in a recursive call), 2 in the model, 1 in a CUDA call under a launch
        f"{MAIN};{STEPS};{PACK};gpu_memory (torch_pagecomp/offload/_batch.py:144) 2",
        f"{MAIN};{STEPS};{PACK};{PACK.replace('420', '440')} 1",
        f"{MAIN};{STEPS};{PACK} 1",
        f"{MAIN};{STEPS};forward (torch/nn/modules/linear.py:134) 2",
        f"{MAIN};{STEPS};launch_entry (triton_kernels/launch.py:203);"
        "cuLaunchKernelEx (libcuda.so.1);0x7f00 (libcuda.so.1) 1",
        # the main thread outside them (the attach): its own section
        f"{MAIN};_start_spy (bench/dev_native_sample.py:49) 5",
        # the backward's thread
        "thread (0x2);unpack (torch_pagecomp/offload/_backward.py:150);"
        "restore (torch_pagecomp/offload/_backward.py:227) 3",
        "thread (0x2);sleep (threading.py:10) 1",
        "not a sample line",
    ]) + "\n")
    text = report(str(raw), per_step=2.0)  # 2 samples a step: each sample 0.5 ms a step
    heads = [line for line in text.splitlines() if line.startswith("## thread")]
    assert heads == [
        "## thread main, in the steps: 3.5; in a package frame 2.5",
        f"## thread {MAIN}: 2.5; in a package frame 0.0",
        "## thread thread (0x2), ran the unpack hooks (the backward's): 2.0; in a package "
        "frame 1.5",
    ]
    inclusive = _table(text, "main, in the steps", "Python functions, inclusive")
    assert inclusive["_pack (torch_pagecomp/offload/_hooks.py)"] == 2.0  # 4 samples, not 5
    assert inclusive["forward (torch/nn/modules/linear.py)"] == 1.0
    assert inclusive["_sampled_steps (bench/dev_native_sample.py)"] == 3.5
    exclusive = _table(text, "main, in the steps", "package functions, exclusive (innermost)")
    assert exclusive == {"gpu_memory (torch_pagecomp/offload/_batch.py)": 1.0,
                         "_pack (torch_pagecomp/offload/_hooks.py)": 1.0,
                         "launch_entry (triton_kernels/launch.py)": 0.5}
    assert _table(text, "main, in the steps", "CUDA call") == {
        "cuLaunchKernelEx (libcuda.so.1)": 0.5}
    assert _table(text, "main, in the steps", "innermost native frame") == {
        "0x7f00 (libcuda.so.1)": 0.5}
    backward = _table(text, "thread (0x2)", "package functions, exclusive (innermost)")
    assert backward == {"restore (torch_pagecomp/offload/_backward.py)": 1.5}


def test_report_in_percent_without_steps(tmp_path):
    raw = tmp_path / "spy.txt"
    raw.write_text(f"{MAIN};{STEPS};{PACK} 3\n{MAIN};{STEPS};f (x.py:1) 1\n")
    text = report(str(raw))
    assert "## thread main, in the steps: 100.0; in a package frame 75.0" in text
    assert _table(text, "main, in the steps", "package functions, exclusive (innermost)") == {
        "_pack (torch_pagecomp/offload/_hooks.py)": 75.0}
