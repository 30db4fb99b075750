"""Probe: ``prefer="speed"``'s tuner under batches whose length changes every step, simulated.

On a GPU each run of the tuner costs a model's whole warm-up and tens of steps, so how often it
ends on the slower way cannot be counted there. Here :class:`StepTuner` runs against a fake
clock on thousands of simulated runs. Each pass draws a sequence length ``L`` from the multiples
of 8 in [16, 64] (dynamic padding, lengths from a quarter of the longest to all of it),
offloads ``12,000 * L`` bytes and lasts

    (fixed + bytes / 1e4 * per_byte[arm] + quadratic * L**2 / 64) * (1 + U(-jitter, jitter))
        * exp(d) ms


where the faster arm's ``per_byte`` is ``1 - gap`` and the other's 1: a part every step pays
(optimizer, launches), a part per byte offloaded (the link, or the kernels and a shorter link
time), and attention's part, quadratic in the length. At the mean length the part per byte is
48 ms and the quadratic one (``quadratic`` 1) 25 ms. ``d`` is a slow drift of the whole step,
both arms alike (``--drift SIGMA``: ``d`` follows ``d' = 0.8 d + N(0, SIGMA)``, so spells of
slower passes last a few passes): a host-bound step on a busy host, as BERT-large's on one H200,
whose copied passes ran 133-191 ms a few passes apart (``bench/results/h200_session81``).
With ``--step 64`` every pass has one length (16).

A run is ``--passes`` passes of the default tuner (eight warm-up passes, two trials per arm, a
check of four). The table counts, per case, the runs that ended on the slower arm (its choice,
or any of the last eight passes), the runs whose trials started again (a new workload seen
where there is none), and the mean, over runs, of the last 20 passes' time over what the
faster arm would have taken on the same lengths.

    python -m bench.dev_tuner_sim --runs 400

The tuner imported is printed (point ``PYTHONPATH`` at another checkout to compare).
``--check interleaved`` runs :class:`InterleavedCheck`, an experiment on the check (not in the
package).
"""

from __future__ import annotations

import argparse
import math
import random
import statistics

from torch_pagecomp.offload import _tune
from torch_pagecomp.offload._tune import StepTuner

CASES = [  # (fixed ms, quadratic, jitter)
    (0.0, 0.0, 0.02), (20.0, 0.0, 0.02), (0.0, 1.0, 0.02), (20.0, 1.0, 0.02),
    (0.0, 0.0, 0.10), (20.0, 0.0, 0.10), (0.0, 1.0, 0.10), (20.0, 1.0, 0.10),
]
TAIL = 20


class InterleavedCheck(StepTuner):
    """``--check interleaved``, an experiment: where the package's check (item 4 of
    ``_tune``) times the other arm's settled passes after the chosen arm's, this one times
    ``trials`` more pairs of each arm, alternating as the trials do, and every pass of each
    arm (trials, the chosen arm's settled passes, the new pairs) decides together: a slow
    spell of the host then falls on both arms alike."""

    _extra: list | None = None  # (the first trials' passes, the chosen arm's settled ones)

    def _check_settled(self) -> None:
        if self._settled_holds(self._shape())[0]:
            self._final()
            return
        other = "copy" if self.choice == "compress" else "compress"
        self._extra = [{a: list(v) for a, v in self._trial_raw.items()},
                       (self.choice, self._settled_raw[1:])]
        self._trial_raw = {a: [] for a in _tune.ARMS}
        pairs = [(a, t) for a in (other, self.choice) for t in (False, True)]
        self._schedule, self._phase = pairs * self.trials, "trial"
        self.history.append({"choice": self.choice, "measuring": True})

    def _decide(self) -> None:
        if self._extra is None:
            return super()._decide()
        first, (arm, settled) = self._extra
        self._extra = None
        passes = {a: first[a] + self._trial_raw[a] for a in _tune.ARMS}
        passes[arm] += settled
        self._trial_raw, self._settled_raw = passes, []
        shape = self._shape()
        best = {a: statistics.median(self._at_usual(v, shape)) for a, v in passes.items()}
        self.choice = self._choose(best)
        self._phase, self._settled = "settled", 0
        self._final()
        self.history.append({"choice": self.choice, "checked": True})


TUNERS = {"package": StepTuner, "interleaved": InterleavedCheck}


class FakeClock:
    """``perf_counter`` stand-in (seconds): ``advance(ms)`` makes time pass."""

    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, ms: float) -> None:
        self.t += ms / 1e3


def one_run(seed: int, fixed: float, quadratic: float, jitter: float, faster: str,
            gap: float, passes: int, first: float = 0.0,
            step: int = 8, drift: float = 0.0,
            tuner_class: type = StepTuner) -> tuple[bool, bool, float]:
    """(ended on the slower arm, trials started again, last passes' time over the faster's).
    ``first``: ms the first pass at each length pays on top (whatever the arm); ``step``:
    the lengths' spacing; ``drift``: the step's slow drift (see the module docstring)."""
    rng = random.Random(seed)
    seen = set()
    clock = FakeClock()
    tuner = tuner_class(retune=10_000, clock=clock)
    per_byte = {a: (1 - gap if a == faster else 1.0) for a in _tune.ARMS}
    arms, took, best = [], [], []
    d = 0.0
    for _ in range(passes):
        arm = tuner.start_pass()
        length = rng.randrange(16, 65, step)
        nbytes = 12_000 * length
        tuner.add_bytes(nbytes)
        noise = 1 + rng.uniform(-jitter, jitter)
        if drift:
            d = 0.8 * d + rng.gauss(0.0, drift)
            noise *= math.exp(d)
        rest = fixed + quadratic * length * length / 64 + (first if length not in seen else 0)
        seen.add(length)
        ms = (rest + nbytes / 1e4 * per_byte[arm]) * noise
        arms.append(arm)
        took.append(ms)
        best.append((rest + nbytes / 1e4 * per_byte[faster]) * noise)
        clock.advance(ms)
    wrong = tuner.choice != faster or any(a != faster for a in arms[-8:])
    decisions = sum(1 for d in tuner.history if not d.get("measuring") and not d.get("checked"))
    return wrong, decisions > 1, sum(took[-TAIL:]) / sum(best[-TAIL:])


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=400)
    ap.add_argument("--passes", type=int, default=80)
    ap.add_argument("--seed", type=int, default=0, help="first run's seed")
    ap.add_argument("--case", action="append", default=None, metavar="FIXED,QUADRATIC,JITTER",
                    help="a case instead of the default eight (repeatable)")
    ap.add_argument("--gaps", default="0.3,0.1", help="the faster arm's saving per byte")
    ap.add_argument("--first", type=float, default=0.0,
                    help="ms the first pass at each length pays on top, whatever the arm (a "
                         "new shape: cuDNN attention's plans, bench.dev_newlength)")
    ap.add_argument("--step", type=int, default=8,
                    help="lengths' spacing in [16, 64]: 8 gives 7 lengths, 1 gives 49")
    ap.add_argument("--drift", type=float, default=0.0,
                    help="SIGMA of the whole step's slow drift, both arms alike (0: none)")
    ap.add_argument("--check", choices=sorted(TUNERS), default="package",
                    help="the package's check, or the experiment InterleavedCheck")
    args = ap.parse_args(argv)
    cases = ([tuple(float(v) for v in c.split(",")) for c in args.case] if args.case
             else CASES)
    ways = [(arm, float(g)) for g in args.gaps.split(",") for arm in ("compress", "copy")]
    print(f"tuner: {_tune.__file__}; {args.runs} runs of {args.passes} passes a case; "
          f"lengths every {args.step} in [16, 64]; a new length's first pass +{args.first:g} ms; "
          f"drift {args.drift:g}; check: {args.check}")
    print("| fixed ms | quadratic | jitter | faster arm (per byte) | ended slower | "
          "trials again | last 20 passes / faster's (mean) |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for fixed, quadratic, jitter in cases:
        for faster, gap in ways:
            res = [one_run(args.seed + i, fixed, quadratic, jitter, faster, gap, args.passes,
                           args.first, args.step, args.drift, TUNERS[args.check])
                   for i in range(args.runs)]
            row = {"fixed": fixed, "quadratic": quadratic, "jitter": jitter, "faster": faster,
                   "gap": gap, "wrong": sum(r[0] for r in res),
                   "again": sum(r[1] for r in res),
                   "tail": statistics.fmean(r[2] for r in res)}
            rows.append(row)
            print(f"| {fixed:g} | {quadratic:g} | {jitter:g} | {faster} ({1 - gap:g}x) | "
                  f"{row['wrong']} / {args.runs} | {row['again']} | {row['tail']:.3f} |")
    return rows


if __name__ == "__main__":
    main()
