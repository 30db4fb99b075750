"""``bench.dev_native_sample.report`` sums py-spy's raw samples per thread, in ms a step given
py-spy's rate and the steps sampled: the main thread's samples in the timed steps (a stack
read without its root frames counted there, unless it is the probe's own attach or stop),
a thread that ran the unpack hooks named the backward's; per thread the time in package
frames, Python functions by inclusive time (once per sample however often a function
recurs), package functions by exclusive time, native frames and CUDA calls."""

from bench.dev_native_sample import report

MAIN = "thread (721): MainThread"  # py-spy's labels (--threads)
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
        # read without its root frames: the steps' all the same
        f"{MAIN};{PACK} 1",
        # the probe's attach: outside the steps
        f"{MAIN};run (bench/dev_native_sample.py:90);_start_spy (bench/dev_native_sample.py:49) 5",
        # the backward's thread, and a thread of the interpreter's own (no Python file: a
        # library named like one is not Python)
        "thread (722);unpack (torch_pagecomp/offload/_backward.py:150);"
        "restore (torch_pagecomp/offload/_backward.py:227) 3",
        "thread (722);sleep (threading.py:10) 1",
        "thread (723);worker (libpython3.12.so.1.0) 2",
        "not a sample line",
    ]) + "\n")
    text = report(str(raw), rate=1000, steps=2)  # each sample: 1 ms over 2 steps, 0.5 a step
    heads = [line for line in text.splitlines() if line.startswith("## thread")]
    assert heads == [
        "## thread main, in the steps: 4.0; in a package frame 3.0",
        f"## thread {MAIN}, outside the steps (the probe's attach and stop): 2.5; in a package "
        "frame 0.0",
        "## thread thread (722), ran the unpack hooks (the backward's): 2.0; in a package "
        "frame 1.5",
        "## thread thread (723): 1.0; in a package frame 0.0",
    ]
    inclusive = _table(text, "main, in the steps", "Python functions, inclusive")
    assert inclusive["_pack (torch_pagecomp/offload/_hooks.py)"] == 2.5  # 5 samples, not 6
    assert inclusive["forward (torch/nn/modules/linear.py)"] == 1.0
    assert inclusive["_sampled_steps (bench/dev_native_sample.py)"] == 3.5
    exclusive = _table(text, "main, in the steps", "package functions, exclusive (innermost)")
    assert exclusive == {"gpu_memory (torch_pagecomp/offload/_batch.py)": 1.0,
                         "_pack (torch_pagecomp/offload/_hooks.py)": 1.5,
                         "launch_entry (triton_kernels/launch.py)": 0.5}
    assert _table(text, "main, in the steps", "CUDA call") == {
        "cuLaunchKernelEx (libcuda.so.1)": 0.5}
    assert _table(text, "main, in the steps", "innermost native frame") == {
        "0x7f00 (libcuda.so.1)": 0.5}
    backward = _table(text, "thread (722)", "package functions, exclusive (innermost)")
    assert backward == {"restore (torch_pagecomp/offload/_backward.py)": 1.5}
    assert "Python functions" not in text.split("## thread thread (723)")[1]


def test_report_in_percent_without_steps(tmp_path):
    raw = tmp_path / "spy.txt"
    raw.write_text(f"{MAIN};{STEPS};{PACK} 3\n{MAIN};{STEPS};f (x.py:1) 1\n"
                   f"{STEPS};{PACK} 4\n")  # a line without a thread label: its own thread
    text = report(str(raw))
    assert "## thread main, in the steps: 100.0; in a package frame 75.0" in text
    assert _table(text, "main, in the steps", "package functions, exclusive (innermost)") == {
        "_pack (torch_pagecomp/offload/_hooks.py)": 75.0}
    assert "## thread ?: 100.0; in a package frame 100.0" in text
