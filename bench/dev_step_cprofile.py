"""Dev probe (#21): cProfile of a stock model's training steps under the offload hooks.

``python3 -m bench.dev_step_cprofile --models encoder-1024 --variants uncompressed,memory``
(GPU): per model and variant, warm steps (and, for ``speed``, until its tuner chose), then
``--steps`` steps under ``cProfile``. Prints the host issue time of plain and profiled steps,
then the functions by own time a step (``--top``), and the package's functions by inclusive
time a step. cProfile adds a fixed cost to every Python call, so compare functions with each
other and variants with each other, not with ``bench.dev_hook_timing``'s totals; the
variants' difference in a function's own time is where the compressed path's extra host time
goes.
"""

from __future__ import annotations

import cProfile
import pstats
import time

from bench.dev_hook_timing import issue_ms, stock_parser, training_step


def _where(key: tuple) -> str:
    path, line, name = key
    if "torch_pagecomp" in path:
        path = "pc/" + path.split("torch_pagecomp/")[-1]
    elif "site-packages/" in path:
        path = path.split("site-packages/")[-1]
    return f"{path}:{line}({name})"


def profile(name: str, variant: str, steps: int, warmup: int, top: int) -> str:
    import torch

    step, off = training_step(name, variant)
    for _ in range(warmup):
        step()
    for _ in range(20):  # prefer="speed": profiled once its tuner has chosen
        if off is None or off.tuner is None or off.tuner.choice is not None:
            break
        step()
    plain = issue_ms(step, steps)
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    profiled = (time.perf_counter() - t0) * 1e3 / steps
    prof.disable()
    torch.cuda.synchronize()
    if off is not None:
        off.remove()
    st = pstats.Stats(prof).stats  # {key: (primitive calls, calls, own s, inclusive s, callers)}
    rows = sorted(st.items(), key=lambda kv: -kv[1][2])
    lines = [f"## {name} {variant}: host issue {plain:.1f} ms a step plain, "
             f"{profiled:.1f} ms profiled",
             "| function (own time) | calls / step | own ms / step | own us / call |",
             "|---|---|---|---|"]
    for key, (_, calls, own, _, _) in rows[:top]:
        lines.append(f"| {_where(key)} | {calls / steps:.0f} | {own * 1e3 / steps:.2f} | "
                     f"{own * 1e6 / max(1, calls):.1f} |")
    pkg = sorted(((k, v) for k, v in st.items() if "torch_pagecomp" in k[0]),
                 key=lambda kv: -kv[1][3])
    lines += ["", "| package function (inclusive) | calls / step | ms / step | us / call |",
              "|---|---|---|---|"]
    for key, (_, calls, _, incl, _) in pkg[:top]:
        lines.append(f"| {_where(key)} | {calls / steps:.0f} | {incl * 1e3 / steps:.2f} | "
                     f"{incl * 1e6 / max(1, calls):.1f} |")
    return "\n".join(lines)


def main() -> None:
    ap = stock_parser("uncompressed,memory")
    ap.add_argument("--top", type=int, default=45)
    a = ap.parse_args()
    for name in a.models.split(","):
        for variant in a.variants.split(","):
            print(profile(name, variant, a.steps, a.warmup, a.top), flush=True)
            print(flush=True)


if __name__ == "__main__":
    main()
