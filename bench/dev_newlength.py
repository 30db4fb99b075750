"""Dev probe: what the first step at a new sequence length costs with no offload at all.

Under ``bench.dev_varlen`` (a new length each round, the arms interleaved), whichever arm ran
first in a round, ``none`` included, often ran about 100 ms over its median
(``bench/results/h200_session80``): the first step at a length pays for something once per
length, whatever the hooks do. This times steps of a stock model with no hooks at lengths
that come twice in a row (new, then seen), per SDPA backend setting, so the cost is seen
alone and the part of it that each backend's per-shape work takes.

``python3 -m bench.dev_newlength --model encoder-1024 --lengths 8`` (GPU; on the CPU a smoke
test on the tiny models).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from bench.stock_models import MODELS

# the SDPA settings timed, one after another in one process: each has lengths of its own, so
# every "new" step is new to it
SETTINGS = ("default", "no-cudnn", "math")


def _sdpa(setting: str):
    """A context manager running SDPA under ``setting``."""
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel

    if setting == "default":
        return contextlib.nullcontext()
    if setting == "no-cudnn":
        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                            SDPBackend.MATH])
    if setting == "math":
        return sdpa_kernel([SDPBackend.MATH])
    raise ValueError(setting)


def measure(name: str, count: int, device: str) -> list[str]:
    import torch

    from bench.stock_models import build

    model, x, _ = build(name, device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    seq = x.shape[1]
    cuda = device == "cuda"

    def step(length: int) -> float:
        inp = x[:, :length]
        if cuda:
            e0, e1 = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            e0.record()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        model(inp).float().square().mean().backward()
        opt.step()
        if cuda:
            e1.record()
            e1.synchronize()
            return e0.elapsed_time(e1)
        return (time.perf_counter() - t0) * 1e3

    step(seq)  # kernels load, the allocator grows to the longest length
    step(seq)
    out = [f"## {name}: {count} new lengths per setting, each stepped twice (batch {x.shape[0]})",
           "| SDPA | new length: median ms | same length again: median ms | difference ms |",
           "|---|---|---|---|"]
    # lengths no setting shares: multiples of 8 below seq, dealt out in turn
    lengths = list(range(seq - 8, 7, -8))
    for k, setting in enumerate(SETTINGS):
        new, seen = [], []
        with _sdpa(setting):
            for length in lengths[k::len(SETTINGS)][:count]:
                new.append(step(length))
                seen.append(step(length))
        a, b = statistics.median(new), statistics.median(seen)
        out.append(f"| {setting} | {a:.1f} | {b:.1f} | {a - b:.1f} |")
    return out


def main(argv=None) -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="encoder-1024")
    ap.add_argument("--lengths", type=int, default=8, help="new lengths per setting")
    args = ap.parse_args(argv)
    if args.model not in MODELS:
        ap.error(f"--model: one of {', '.join(MODELS)}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print("\n".join(measure(args.model, args.lengths, device)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
