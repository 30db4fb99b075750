"""Dev probe: training steps whose sequence length changes from step to step (#21).

A fine-tuning loop with dynamic padding (transformers' ``DataCollatorWithPadding``, padding each
batch to its longest sequence, ``pad_to_multiple_of=8``; torchtune without packing) saves
activations of another shape at every step. The stock bench runs one shape, so it never sees
what that does to the hooks' pools (a plain copy's page-locked buffers are pooled by exact
size) and to ``prefer="speed"``'s tuner (which times whole passes of one workload).

``python3 -m bench.dev_varlen --models encoder-1024,gpt2-768 --arms none,uncompressed,memory,speed``
(GPU; on the CPU a smoke test on the tiny models): one process a model, one offloader per
arm, the arms' steps interleaved (a round is one step of each arm, the order rotating, all
at that round's length, so every arm sees the same lengths and the same host). Each arm's
timed step follows ``--lead`` untimed ones of its own at the same length (default 1): timed
right after another arm's step, a step paid for that arm's copies still running and, first
in a round, for the new length's first step (cuDNN attention builds its plans per shape:
117 ms on encoder-1024, ``bench.dev_newlength``), which fell on whichever arm came first
(``bench/results/h200_session80``, calls 1 and 3: ``--lead 0``). ``--block K`` runs K rounds
of one arm in a row before the next arm runs the same ones (``--block`` the number of rounds:
each arm alone, as a user runs one; on GPT-2 ``speed``'s trials, run alone, timed compressing
faster than the interleaved rounds did, session 80). Lengths:
``--lengths random`` (the default) draws each round's from the multiples of 8 in ``[seq / 4,
seq]`` (seeded: every run the same sequence); ``fixed`` keeps the stock bench's ``seq``; a
comma list cycles through those. Sequence models only (the input is ``[batch, seq, width]``
embeddings, cut to the round's length).

Before the timed rounds, ``speed`` takes steps of its own until its tuner has decided (and
checked) its choice, and each offloading arm until ``SETTLE`` steps in a row pinned nothing
(at most ``MAX_SETTLE``), at lengths of their own from the same range, the longest first:
the rounds time arms that have grown their page-locked memory, not the growing.

Prints per arm the median step (CUDA events), the median of its step over the same round's
``uncompressed`` and ``none`` steps, the page-locked buffers it made (pinned) and let go
(unpinned) per timed step, the page-locked memory it holds at the end, its GPU peak, and for
``speed`` its tuner's phase, choice and decisions.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time

from bench.dev_ab_steps import _chunks, _hooked
from bench.stock_models import MODELS

ARMS = ("none", "save_on_cpu", "uncompressed", "memory", "speed")
SETTLE, MAX_SETTLE = 4, 12  # an arm's own steps before timing (see :func:`measure`)


def lengths_for(spec: str, seq: int, rounds: int, seed: int = 0) -> list[int]:
    """``rounds`` sequence lengths: ``"random"`` (multiples of 8 in ``[seq // 4, seq]``,
    seeded), ``"fixed"`` (``seq`` each round) or a comma list of lengths, cycled."""
    if spec == "fixed":
        return [seq] * rounds
    if spec == "random":
        rng = random.Random(seed)
        lo = max(8, seq // 4 // 8 * 8)
        return [rng.randrange(lo, seq + 1, 8) for _ in range(rounds)]
    given = [int(v) for v in spec.split(",")]
    if any(not 0 < v <= seq for v in given):
        raise ValueError(f"--lengths: each in 1..{seq} (the model's sequence), got {given}")
    return [given[i % len(given)] for i in range(rounds)]


def measure(name: str, arms: list[str], lengths: list[int], warmup: int,
            device: str, lead: int = 1, block: int = 1) -> list[str]:
    """The table of ``arms`` on model ``name`` over rounds of ``lengths`` (the first
    ``warmup`` rounds untimed; ``lead`` untimed steps of each arm before its timed one;
    ``block`` rounds of one arm in a row before the next arm's same rounds)."""
    import torch

    from bench.stock_models import build, variant_settings
    from bench.training_bench import CountingSaveOnCpu
    from torch_pagecomp import ActivationOffloader

    cuda = device == "cuda"
    model, x, blocks = build(name, device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    offs = {a: ActivationOffloader(**variant_settings(a, device)) for a in arms
            if a not in ("none", "save_on_cpu")}
    saver = CountingSaveOnCpu() if "save_on_cpu" in arms else None

    def step(arm: str, length: int) -> tuple[float, float]:
        """One SGD step of ``arm`` at ``length``: ``(ms, GPU peak GiB)``."""
        inp = x[:, :length]
        gc.disable()
        try:
            with _hooked(model, blocks, offs.get(arm)):
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                    e0, e1 = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                    e0.record()
                t0 = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                if arm == "save_on_cpu":
                    with saver:
                        loss = model(inp).float().square().mean()
                else:
                    loss = model(inp).float().square().mean()
                loss.backward()
                opt.step()
                ms = (time.perf_counter() - t0) * 1e3
                if cuda:
                    e1.record()
                    e1.synchronize()
                    ms = e0.elapsed_time(e1)
        finally:
            gc.enable()
            gc.collect(1)
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
        return ms, peak

    # before the timed rounds, as ``bench.dev_ab_steps`` does: ``speed`` its own steps until
    # its tuner has decided and checked the choice (its trials alternate the ways), then each
    # offloading arm its own until SETTLE steps in a row pinned nothing (at most MAX_SETTLE),
    # at lengths of their own from the same range
    extra = iter(lengths_for("random" if len(set(lengths)) > 1 else "fixed", max(lengths),
                             10 * MAX_SETTLE, seed=len(lengths)))
    settling = {}
    if "speed" in offs:
        tuner, k = offs["speed"].tuner, 0
        while k < 5 * MAX_SETTLE and (tuner.choice is None or tuner.checking):
            step("speed", next(extra))
            k += 1
        settling["speed (tuner)"] = k
    for arm, off in offs.items():
        quiet = k = 0
        while quiet < SETTLE and k < MAX_SETTLE:
            had = _chunks(off)[0]
            # the longest length first: the arenas then hold what the longest step needs
            # before the timed rounds (else they pinned for each new longest length as it
            # came: GPT-2's plain copy 1.5 chunks a step in session 78's call 5)
            step(arm, max(lengths) if k == 0 else next(extra))
            k += 1
            quiet = quiet + 1 if _chunks(off)[0] == had else 0
        settling[arm] = k
    times = {a: [] for a in arms}
    leads = {a: [] for a in arms}  # the untimed steps before each timed one
    peaks = {a: 0.0 for a in arms}
    made = {a: [0, 0] for a in offs}  # pinned / unpinned in the timed rounds
    ways = []  # the way speed's tuner gave each timed step
    for c, first in enumerate(range(0, len(lengths), block)):
        rounds = range(first, min(first + block, len(lengths)))
        if c == warmup // block:  # the chunk holding the first timed round
            for off in offs.values():
                off.reset_peak_stats()
        for arm in arms[c % len(arms):] + arms[:c % len(arms)]:
            for r in rounds:
                length, timed = lengths[r], r >= warmup
                before = _chunks(offs[arm]) if arm in offs else None
                for _ in range(lead):
                    # untimed, at the same length: it pays for the arm before (whose copies
                    # and kernels may still run) and for the length's first step (cuDNN
                    # attention's plans, bench.dev_newlength), which fell on whichever arm
                    # came first
                    ms, _ = step(arm, length)
                    if timed:
                        leads[arm].append(ms)
                ms, peak = step(arm, length)
                if not timed:
                    continue
                times[arm].append(ms)
                if arm == "speed":
                    ways.append(offs[arm].tuner.arm)
                peaks[arm] = max(peaks[arm], peak)
                if before is not None:
                    after = _chunks(offs[arm])
                    made[arm][0] += after[0] - before[0]
                    made[arm][1] += after[1] - before[1]
    n = len(lengths) - warmup
    out = [f"## {name}: {n} timed rounds after {warmup} ({lead} untimed step of each arm "
           f"before its timed one; {block} round(s) of an arm in a row), lengths "
           f"{min(lengths)}-"
           f"{max(lengths)} ({len(set(lengths))} distinct; batch {x.shape[0]}, up to "
           f"{x.shape[1]}); settling steps first (own lengths): "
           + ", ".join(f"{a} {k}" for a, k in settling.items()),
           "| arm | step ms (median) | min-max | x uncompressed (same round, median) | "
           "x none (median) | pinned / unpinned a step | page-locked GiB held | GPU peak GiB | "
           "untimed step before (median) |",
           "|---|---|---|---|---|---|---|---|---|"]

    def over(arm: str, base: str) -> str:
        if base not in times or arm == base:
            return "-"
        return f"{statistics.median(a / b for a, b in zip(times[arm], times[base])):.2f}x"

    for arm in arms:
        ts = times[arm]
        pins = (f"{made[arm][0] / n:.1f} / {made[arm][1] / n:.1f}" if arm in made else "-")
        held = "-"
        if arm in offs:
            st = offs[arm].stats()
            arena = sum(c["host_held_bytes"] for c in st.get("compressor", {}).values())
            held = f"{(st['pinned_held_bytes'] + arena) / 2**30:.2f}"
        out.append(f"| {arm} | {statistics.median(ts):.1f} | {min(ts):.1f}-{max(ts):.1f} | "
                   f"{over(arm, 'uncompressed')} | {over(arm, 'none')} | {pins} | {held} | "
                   f"{peaks[arm]:.3f} | "
                   f"{statistics.median(leads[arm]) if leads[arm] else 0:.1f} |")
    if "speed" in offs:
        tuner = offs["speed"].stats()["tuner"]
        out.append(f"speed's tuner: phase {tuner['phase']}, choice {tuner['choice']}, "
                   f"decisions {tuner['decisions']}")
        # what the tuner timed (ms, bytes), to read the shape of a pass's time against its
        # bytes on a real step (bench/dev_tuner_sim.py simulates both shapes)
        raw = offs["speed"].tuner._trial_raw
        out.append("speed's last trial passes (ms, bytes): "
                   + "; ".join(f"{a} {[(round(m, 1), b) for m, b in v]}" for a, v in raw.items()))
    # every timed round: its length and each arm's ms (speed: and its way), for the shape of
    # time against length
    out.append("per round: length | " + " | ".join(arms))
    for r, length in enumerate(lengths[warmup:]):
        cells = [f"{times[a][r]:.1f}" + (f" {ways[r]}" if a == "speed" else "") for a in arms]
        out.append(f"  {length} | " + " | ".join(cells))
    for off in offs.values():
        off.close()
    return out


def main(argv=None) -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="encoder-1024")
    ap.add_argument("--arms", default="none,uncompressed,memory,speed")
    ap.add_argument("--rounds", type=int, default=24, help="timed rounds")
    ap.add_argument("--warmup", type=int, default=6, help="untimed rounds first")
    ap.add_argument("--lengths", default="random", help="random, fixed, or a comma list")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lead", type=int, default=1,
                    help="untimed steps of each arm, at the round's length, before its timed "
                         "one (0: each arm's step right after the arm before's, as before "
                         "session 80)")
    ap.add_argument("--block", type=int, default=1,
                    help="rounds of one arm in a row before the next arm runs the same ones "
                         "(1: the arms interleaved step by step; the whole count: each arm "
                         "alone, as a user runs one)")
    args = ap.parse_args(argv)
    arms = args.arms.split(",")
    if args.block < 1 or args.lead < 0:
        ap.error(f"--block at least 1 and --lead at least 0, got {args.block} and {args.lead}")
    if any(a not in ARMS for a in arms):
        ap.error(f"--arms: each one of {', '.join(ARMS)}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for name in args.models.split(","):
        family, _, _, _, seq = MODELS[name]
        if family.startswith("tv-") or family == "resnet":
            ap.error(f"--models: {name} takes images, not sequences")
        lengths = lengths_for(args.lengths, seq, args.warmup + args.rounds, args.seed)
        print("\n".join(measure(name, arms, lengths, args.warmup, device, args.lead,
                                 args.block)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
