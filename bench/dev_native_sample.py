"""Dev probe: where the host's time goes in steady-state training steps, native frames included.

``python3 -m bench.dev_native_sample --model encoder-1024 --variant memory`` runs a stock
model's SGD step (``bench.dev_hook_timing.training_step``) back to back, as a training loop
does, and prints each phase's host issue time (ms a step, median): steps run back to back,
and steps that each start on an idle GPU (``torch.cuda.synchronize()`` first). The gap
between the two is host time spent blocked on the GPU (a launch queue full, an allocator
call, an event or copy that waits), which the Python-level samplers of ``dev_ab_steps`` and
the timers of ``dev_hook_timing`` charge to whatever Python line was running.

``--spy spy.txt`` (py-spy installed, ptrace allowed): py-spy samples every thread of this
process while the back-to-back steps run (attached after the warm-up, stopped after them),
and the probe then sums the samples by thread and by innermost package frame, innermost
Python frame and innermost native frame (``--report spy.txt`` does the summing alone).
py-spy reads the process's memory without taking the GIL (``--nonblocking``: without pausing
it either), so its samples are not drawn to the lines that release the GIL, as those of the
in-process sampler of ``dev_ab_steps --sample-host`` are. ``--native`` adds native frames,
but py-spy then pauses the process to unwind each sample: at 500 samples a second that made
encoder-1024's steps about 20x longer on an H200 host (1.15-1.39 s against 54-77 ms), so
the proportions it gives are those of a process that the GPU never holds up.
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
    spy = subprocess.Popen(["py-spy", "record", "--pid", str(os.getpid()), *how, "--idle",
                            "--threads", "-r", str(rate), "-f", "raw", "-o", path],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    time.sleep(3.0)  # its attach; a sample of the idle process costs nothing we report
    if spy.poll() is not None:
        raise RuntimeError(f"py-spy ended at once: {spy.stderr.read()[-2000:]}")
    return spy


def _stop_spy(spy) -> None:
    import signal

    spy.send_signal(signal.SIGINT)  # py-spy writes its file on an interrupt
    try:
        spy.wait(timeout=60)
    except Exception:  # noqa: BLE001 - a probe: do not hang on it
        spy.kill()


def run(model: str, variant: str, warmup: int, steps: int, spy_path: str | None = None,
        rate: int = 500, native: bool = False) -> float:
    """Print the steps' host issue times; return the sampled steps' wall ms a step."""
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
    t0 = time.perf_counter()
    issue = _sampled_steps(step, steps)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e3 / steps
    if spy is not None:
        _stop_spy(spy)
    print(f"{model} {variant}: host issue ms a step, back to back {statistics.median(issue):.1f}"
          f" (wall {wall:.1f} a step), each step on an idle GPU "
          f"{statistics.median(synced):.1f}", flush=True)
    if off is not None:
        off.remove()
    return wall


_FRAME = re.compile(r"^(?P<fn>.*?) \((?P<where>[^()]*)\)$")


def _parse(frame: str) -> tuple[str, str]:
    """``(function, file or library)`` of one py-spy frame, ``"fn (file.py:12)"``."""
    m = _FRAME.match(frame.strip())
    return (m["fn"], m["where"]) if m else (frame.strip(), "")


# the outermost CUDA runtime or driver call of a stack: which API the host is inside
_CUDA_API = re.compile(r"^(cuda[A-Z]\w*|cu[A-Z]\w*|nccl[A-Z]\w*)")


def _is_python(where: str) -> bool:
    return ".py" in where


def report(path: str, top: int = 25, per_step: float | None = None) -> str:
    """The samples of ``path`` (py-spy's raw format), each thread apart: the main thread's
    inside ``_sampled_steps``, a thread that ran the unpack hooks named the backward's. Per
    thread: the time inside any package frame; Python functions by inclusive time (a sample
    counts once for each function in its stack); package functions by exclusive time (the
    innermost); the innermost native frame and CUDA call where there are native frames. In
    ms a step where ``per_step`` (samples a step: rate x seconds / steps) is given, else in
    % of the thread's samples."""
    stacks: dict = collections.defaultdict(list)  # thread -> [(parsed frames, count)]
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            frames = stack.split(";")
            thread = frames[0] if frames[0].startswith(("thread", "process")) else "?"
            if any(SAMPLED in fr for fr in frames):
                thread = "main, in the steps"
            stacks[thread].append(([_parse(fr) for fr in frames[1:]], int(count)))
    lines = [f"# {path}: samples by thread while the steps ran"
             + (f" (ms a step: {per_step:.1f} samples a step)" if per_step else " (%)")]
    ordered = sorted(stacks.items(), key=lambda kv: -sum(n for _, n in kv[1]))
    for thread, samples in ordered:
        total = sum(n for _, n in samples)
        if any("unpack" in fn and "torch_pagecomp" in w for fr, _ in samples for fn, w in fr):
            thread += ", ran the unpack hooks (the backward's)"
        scale = (1.0 / per_step) if per_step else 100.0 / total
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
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--spy", default=None, help="py-spy's raw samples of the steps to this path")
    ap.add_argument("--rate", type=int, default=500, help="py-spy's samples a second")
    ap.add_argument("--native", action="store_true",
                    help="native frames too (py-spy pauses the process: see the docstring)")
    ap.add_argument("--report", default=None, help="summarise a py-spy raw file instead")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--step-ms", type=float, default=None,
                    help="with --report: the steps' wall ms each, for times in ms a step")
    a = ap.parse_args()
    if a.report:
        print(report(a.report, a.top, a.rate * 1e-3 * a.step_ms if a.step_ms else None))
        return
    ms = run(a.model, a.variant, a.warmup, a.steps, a.spy, a.rate, a.native)
    if a.spy:
        print(report(a.spy, a.top, a.rate * 1e-3 * ms), flush=True)


if __name__ == "__main__":
    main()
