"""Dev probe: where the host's time goes in steady-state training steps, sampled by py-spy.

``python3 -m bench.dev_native_sample --model encoder-1024 --variant memory`` runs a stock
model's SGD step (``bench.dev_hook_timing.training_step``) back to back, as a training loop
does, and prints the host issue time (ms a step, median) of those steps and of steps that
each start on an idle GPU (``torch.cuda.synchronize()`` first). Where the back-to-back steps
take longer, the host spends that time blocked on the GPU (a launch queue full, an allocator
call, an event or copy that waits).

``--spy spy.txt`` (py-spy installed, ptrace allowed): py-spy samples every thread of this
process (attached after the warm-up, stopped after the back-to-back steps), and the probe
sums the samples per thread: the time inside package frames, Python functions by inclusive
time, package functions by exclusive time, and with ``--native`` the innermost native frame
and the outermost CUDA call, in ms a step (``--report spy.txt --rate R --steps N`` does the
summing alone). py-spy reads the process's memory without taking the GIL (``--nonblocking``:
without pausing it either), so its samples fall evenly over time, not on the lines that let
the GIL go, as those of the in-process sampler of ``dev_ab_steps --sample-host`` do. Some
non-blocking samples are read without their root frames: the main thread's samples outside
the probe's own attach and stop are counted as the steps'. The other threads' samples
include the ~3 s of the attach, idle (their package time does not). ``--native`` adds native
frames, but py-spy then pauses the process to unwind each sample: at 500 samples a second
encoder-1024's steps took 1.14-1.36 s of wall time each on an H200 host, against 54-77 ms,
so its proportions are those of a process the GPU never holds up
(``bench/results/h200_session76``).
"""

from __future__ import annotations

import argparse
import collections
import gc
import re
import statistics
import time

SAMPLED = "_sampled_steps"


def _sampled_steps(step, n: int) -> list[float]:
    """``n`` steps back to back: each one's host issue ms (the frame py-spy's report keeps)."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        out.append((time.perf_counter() - t0) * 1e3)
        gc.collect(1)  # (outside the time, as dev_ab_steps' --gc manual)
    return out


def _start_spy(path: str, rate: int, native: bool):
    """py-spy sampling this process into ``path`` (raw format), once it has attached."""
    import os
    import subprocess

    how = ["--native"] if native else ["--nonblocking"]
    with open(path + ".log", "w") as log:  # (a pipe nobody reads could fill and stall it)
        spy = subprocess.Popen(["py-spy", "record", "--pid", str(os.getpid()), *how, "--idle",
                                "--threads", "-r", str(rate), "-f", "raw", "-o", path],
                               stdout=subprocess.DEVNULL, stderr=log)
    time.sleep(3.0)  # its attach (the samples of this sleep fall outside the steps' section)
    if spy.poll() is not None:
        with open(path + ".log") as log:
            raise RuntimeError(f"py-spy ended at once: {log.read()[-2000:]}")
    return spy


def _stop_spy(spy) -> None:
    import signal
    import subprocess

    spy.send_signal(signal.SIGINT)  # py-spy writes its file on an interrupt
    try:
        spy.wait(timeout=60)
    except subprocess.TimeoutExpired:  # a probe: do not hang on it (no file then)
        spy.kill()
        spy.wait()


def run(model: str, variant: str, warmup: int, steps: int, spy_path: str | None = None,
        rate: int = 500, native: bool = False) -> None:
    """Print the steps' host issue times and their wall time a step."""
    import torch

    from bench.dev_hook_timing import training_step

    step, off = training_step(model, variant)
    gc.disable()
    for _ in range(warmup):
        step()
        gc.collect(1)
    torch.cuda.synchronize()
    synced = []
    for _ in range(max(4, steps // 4)):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        synced.append((time.perf_counter() - t0) * 1e3)
        gc.collect(1)
    torch.cuda.synchronize()
    spy = _start_spy(spy_path, rate, native) if spy_path else None
    try:
        t0 = time.perf_counter()
        issue = _sampled_steps(step, steps)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3 / steps
    finally:
        if spy is not None:
            _stop_spy(spy)
    print(f"{model} {variant}: host issue ms a step, back to back {statistics.median(issue):.1f}"
          f" (wall {wall:.1f} a step), each step on an idle GPU "
          f"{statistics.median(synced):.1f}", flush=True)
    if off is not None:
        off.remove()
    gc.enable()


_FRAME = re.compile(r"^(?P<fn>.*?) \((?P<where>[^()]*)\)$")
_LABEL = ("thread (", "process ")  # py-spy's labels before a stack (--threads, --subprocesses)
_OWN = ("_start_spy", "_stop_spy")  # the probe's own frames outside the steps


def _parse(frame: str) -> tuple[str, str]:
    """``(function, file or library)`` of one py-spy frame, ``"fn (file.py:12)"``."""
    m = _FRAME.match(frame.strip())
    return (m["fn"], m["where"]) if m else (frame.strip(), "")


# the outermost CUDA runtime or driver call of a stack: which API the host is inside
_CUDA_API = re.compile(r"^(cuda[A-Z]\w*|cu[A-Z]\w*|nccl[A-Z]\w*)")
_PYTHON_FILE = re.compile(r"\.py(:\d+)?$")


def _is_python(where: str) -> bool:
    return _PYTHON_FILE.search(where) is not None


def _samples(path: str) -> dict:
    """py-spy's raw file as ``{thread label: [(parsed frames, root first), count)]}``; the
    main thread's samples split into the steps' and the probe's own (attach and stop)."""
    stacks: dict = collections.defaultdict(list)
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            frames = stack.split(";")
            labels = []
            while frames and frames[0].startswith(_LABEL):
                labels.append(frames.pop(0))
            stacks[" ".join(labels) or "?"].append(([_parse(fr) for fr in frames], int(count)))
    main = next((t for t, ss in stacks.items()
                 if any(fn == SAMPLED for fr, _ in ss for fn, _ in fr)), None)
    if main is not None:  # stacks read without their root: the steps' unless the probe's own
        ss = stacks.pop(main)
        own = [(fr, n) for fr, n in ss if any(fn in _OWN for fn, _ in fr)]
        stacks[f"{main}, outside the steps (the probe's attach and stop)"] = own
        stacks["main, in the steps"] = [(fr, n) for fr, n in ss
                                        if not any(fn in _OWN for fn, _ in fr)]
    return stacks


def report(path: str, top: int = 25, rate: float | None = None,
           steps: int | None = None) -> str:
    """The samples of ``path`` (py-spy's raw format) per thread (see :func:`_samples`; a
    thread that ran the unpack hooks is named the backward's): the time inside package
    frames; Python functions by inclusive time (a sample counts once for each function in
    its stack); package functions by exclusive time (the innermost); the innermost native
    frame and the outermost CUDA call where there are native frames. In ms a step where
    ``rate`` (py-spy's samples a second) and ``steps`` (the steps sampled) are given, else
    in % of the thread's samples."""
    ms_each = 1e3 / (rate * steps) if rate and steps else None
    lines = [f"# {path}: samples by thread"
             + (" (ms a step)" if ms_each else " (% of the thread's samples)")]
    ordered = sorted(_samples(path).items(), key=lambda kv: -sum(n for _, n in kv[1]))
    for thread, samples in ordered:
        total = sum(n for _, n in samples)
        if not total:
            continue
        if any("unpack" in fn and "torch_pagecomp" in w for fr, _ in samples for fn, w in fr):
            thread += ", ran the unpack hooks (the backward's)"
        scale = ms_each or 100.0 / total
        by = {k: collections.Counter() for k in ("inclusive", "package", "native", "api")}
        in_package = 0
        for parsed, n in samples:
            seen = {f"{fn} ({w.rsplit(':', 1)[0]})" for fn, w in parsed if _is_python(w)}
            by["inclusive"].update(dict.fromkeys(seen, n))
            pkg = next((f"{fn} ({w.rsplit(':', 1)[0]})" for fn, w in reversed(parsed)
                        if "torch_pagecomp" in w or "triton_kernels" in w), None)
            if pkg is not None:
                in_package += n
                by["package"][pkg] += n
            nat = next((f"{fn} ({w})" for fn, w in reversed(parsed)
                        if w and not _is_python(w)), None)
            if nat is not None:
                by["native"][nat] += n
            api = next((f"{fn} ({w})" for fn, w in parsed if _CUDA_API.match(fn)), None)
            if api is not None:
                by["api"][api] += n
        lines.append(f"## thread {thread}: {total * scale:.1f}; in a package frame "
                     f"{in_package * scale:.1f}")
        for kind, title in (("inclusive", "Python functions, inclusive"),
                            ("package", "package functions, exclusive (innermost)"),
                            ("native", "innermost native frame"), ("api", "CUDA call")):
            if not by[kind]:
                continue
            lines += [f"### {title}", "| function | time |", "|---|---|"]
            lines += [f"| {name} | {n * scale:.2f} |" for name, n in by[kind].most_common(top)]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="encoder-1024")
    ap.add_argument("--variant", default="memory")
    ap.add_argument("--warmup", type=int, default=12)
    ap.add_argument("--steps", type=int, default=None,
                    help="back-to-back steps (30); with --report, the steps the file sampled "
                    "(times in ms a step; without it in %%)")
    ap.add_argument("--spy", default=None, help="py-spy's raw samples of the steps to this path")
    ap.add_argument("--rate", type=int, default=500, help="py-spy's samples a second")
    ap.add_argument("--native", action="store_true",
                    help="native frames too (py-spy pauses the process: see the docstring)")
    ap.add_argument("--report", default=None, help="summarise a py-spy raw file instead")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    if a.report:
        print(report(a.report, a.top, a.rate, a.steps))
        return
    steps = a.steps or 30
    run(a.model, a.variant, a.warmup, steps, a.spy, a.rate, a.native)
    if a.spy:
        print(report(a.spy, a.top, a.rate, steps), flush=True)


if __name__ == "__main__":
    main()
