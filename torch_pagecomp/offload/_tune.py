"""``prefer="speed"``: compress the offload only where that makes the training step faster.

Compressing activations costs GPU time (the kernels share the SMs with the model) and saves link
time (the copy engine moves ``ratio`` times fewer bytes). Which one wins depends on the step, not
on the data. Where the plain copies already hide behind the model's compute, every compressed
byte only adds kernel time; where the link is the bottleneck, compression shortens the step.
Both happen in one model: offloading every block of a GPT, the link bounds the step and
compression shortens it; offloading only the first few, the copies hide and compression adds
about the kernels' time for those bytes.

Neither the schedule nor the model's compute time can be read without a host sync, so
:class:`StepTuner` times the passes themselves (one pass: one outermost ``with`` of the hooks,
from its start to the next one's, so the period holds the whole step as the loop runs it). The
marks are CUDA events recorded on the current stream (GPU time, whatever the host runs ahead;
read once completed, never waited for), or the host clock without CUDA:

1. ``warmup`` passes compress (kernels compile, pools grow, the class policy samples ratios).
   Eight by default: after two, the first trials still ran on a cold process (the arena and
   the allocator growing), and on one H200 ResNet-50's tuner chose compressing at 1.10x a
   plain copy where, with eight, it copied at 0.95x (``bench/results/h200_session64``);
2. ``trials`` pairs of passes per arm, alternating ``"copy"`` (every offload a plain pinned
   copy) and ``"compress"``, of which the second pass of each pair is timed; an arm's time is
   the shortest of its timed passes (a pass that grew a pool or compiled a kernel is slower
   once, never faster). A pass's offloads finish on side streams after its period ends, in
   the next pass's: timed right after the other arm, a compressed pass left its packing to
   the copied pass after it, which then looked slower and itself faster. On encoder-1024 the
   tuner chose compressing on a 55.8 ms compressed pass against 59.7 copied, then ran 82-83
   ms a step, 1.71x the copied steps; on encoder-2048 copied trials ran 4% above copied
   steps (``bench/results/h200_cbb2caa_session28``). The second pass of a pair follows its
   own arm, as every settled pass does;
3. once they are measured, the faster arm is kept for ``retune`` passes; ``"copy"`` only if
   it is faster by more than ``margin`` (on a tie compression still saves host memory). Then
   the trials run again, and at once when the passes take a different amount to offload than
   the trials did: a new sequence length or model (the bytes taken, not those stored, which
   differ by arm). A training loop with dynamic padding (each batch padded to its longest
   sequence) offloads another amount every pass: the trials started again whenever one pass
   took a quarter more or less than the first trial pass, so they never ended, the passes
   alternated between the arms for good, and a copied trial at a shorter length could win
   the decision (``bench.dev_varlen``, ``bench/results/h200_session78``). So the workload
   counts as new only when each of the last ``RECENT`` passes took more than ``DRIFT`` times
   the most bytes of a trial pass, or each less than the least over ``DRIFT``: a new length
   that stays, after ``RECENT`` passes (set against the trial passes' median instead, the
   median of four to eight random lengths, the trials started again in 11 of 400 simulated
   runs of 80 passes, ``bench.dev_tuner_sim``). A pass's time is set against the others' at
   the trial passes' median bytes, along the shape of time against bytes that the passes
   timed since the trials began show (:func:`time_shape`): a part that does not grow with the
   bytes and one that grows as them, or a power of the bytes where time grows faster. Scaled
   in proportion to its bytes, a short pass carried its step's fixed part many times over:
   with 20 ms a pass that does not grow with the bytes, the tuner ended 35-159 of 400
   simulated runs on the slower arm (the arms 10-30% apart per byte), against 0-88 so
   (``bench/results/cpu_session79``). Each periodic retune that keeps the choice
   doubles the wait for the next, up to ``RETUNE_GROWTH`` times ``retune``; a changed choice
   or a new workload starts again from ``retune``. A retune is not free: the way not chosen gave its
   idle memory back (item 4), so its trials pin it again and the check releases it again. At
   the first tuning under FSDP2 on two H200s the pass that pinned the copies' buffers ran
   1.1-3.7 s and the one that released them 0.3-1.3 s, against steps of 80-240 ms
   (``bench/results/h200x2_0c1353b_session47``). A retune of encoder-2048 on one H200 that
   kept compressing cost 2-3 s so (passes of 1.5-2.2 s and 0.5-0.7 s against 0.115), and
   over 60 passes retuned every 8 the doubling wait spent 10% less time than a fixed one
   (``bench/results/h200x2_96f5538_session48``);
4. the choice is checked against the passes it gives: the median of ``check`` settled
   passes (after the first, which may still pay for the switch) takes the place of the chosen
   arm's trial time in the same rule. Two trial passes per arm can tie where the steps do not:
   on transformers' GPT-2 (d 768, batch 8 x 1024) both arms' trials ran 122 ms, and the
   compressed steps that followed 120-194 ms (median 158) against 134 copied
   (``bench/results/h200_d04bdbf_session34``). If the other arm wins there, it runs ``check``
   settled passes too, and the two medians decide (the same rule), until the next trials.
   Set against the other arm's shortest trial, the median of the chosen arm's own passes
   lost to it by the spread of the steps alone: on encoder-tiny (CPU) the tuner chose copying
   on trials of 5.7 ms against 6.6 and switched to compressing on a copied median of 6.5; on
   the ResNet-style model (H200) it chose copying on trials of 59.0 ms against 61.3, switched
   on a copied median of 62.3, and its compressed steps then ran 73-78 ms
   (``bench/results/h200_7683f39_session44``). A close call, the other arm's shortest trial
   within ``CLOSE`` above the chosen arm's median, is settled by the two medians too: a
   trial can run well above the steps that arm settles into, and the choice then stood on
   that alone. The two arms' settled passes run one arm after the other, so a slow spell of
   the host fell on one arm's: on BERT-large at one length (one H200) the copied trials ran
   134-136 ms against compressing's 149-160, two of the four copied passes of the check
   187-191, the compressed ones after them 146-163, and the tuner compressed on their
   medians (161.9 against 177.2) where compressed steps ran 1.20x copied ones in the same
   run (``bench/results/h200_session81``). So each arm's trial passes and its settled ones
   decide together (the same passes, unscaled: 149.5 against 160.0). Simulated with the whole
   step drifting (``bench.dev_tuner_sim --drift``), that ended fewer runs on the slower
   arm in 96 cases of 192 and more in 7 (by 1-7 runs of 400). Each arm's idle memory is
   given back only once
   the check is done (``ActivationOffloader._tuned_arm``): a switch it takes back would pin
   it all again;
5. a pass that made host memory (pinned an arena chunk or a copy buffer: milliseconds to
   tens of milliseconds each, ``_arena.VirtualArena.shrink``) is not timed as its arm: a
   timed trial pass that did runs again (at most ``2 * trials`` times per trials), and a
   settled one is left out of the check (at most ``check`` times per decision). The
   compressed store's arena grows over the first steps, only while the link is idle, so a
   compressed trial could pay for chunks a settled pass never pins again: on encoder-1024
   two compressed trial passes that pinned three chunks ran 156 and 118 ms, their rerun 79
   (``bench/results/h200_6c7a326_session45``);
6. a pass at an amount of bytes no pass took before is not timed either, as in item 5 (at
   most ``FRESH`` times per trials and per decision): the first step at a new shape pays for
   things once, whatever the arm. With torch 2.11's default attention on an H200 (cuDNN's,
   which builds its plans per shape) encoder-1024's first step at a new length ran 140 ms
   against 23 at the same length again (2.4 ms more with cuDNN's attention off,
   ``bench.dev_newlength``), so under dynamic padding a trial pass was mostly that cost:
   the tuner chose compressing on encoder-1024 and GPT-2, where compressed steps ran 1.19x
   and 1.14x the plain copy's, and ran 1.15x and 1.08x them (``bench.dev_varlen``,
   ``bench/results/h200_session80``). Simulated with a first pass at each length 150 ms
   longer, the tuner before this rule ended 15-159 of 400 runs on the slower arm, as many as
   without that cost with it (0-127; ``bench.dev_tuner_sim --first``); with 49 lengths,
   145-207 before and 0-160 after. On the GPU, with it, encoder-1024 copied (0.95x and
   1.02x the plain copy in two calls); GPT-2 still compressed (1.17-1.25x), its trial passes
   timing compressing faster than the bench's interleaved rounds did. The bytes of a length
   are the same each time it comes (the bytes taken, stored or held), so a length seen
   again is timed.

Passes that offload nothing (evaluation) are not timed and change nothing: a trial pass
handed to one runs after it, and a settled one does not count towards the retune. A
timed trial pass that gives no time (marks that cannot be compared, or a clock that says
0 ms, less or NaN) runs again, at most ``2 * trials`` times per trials.
"""

from __future__ import annotations

import collections
import math
import statistics
import time
from collections.abc import Callable

import torch

from .._args import check_int, check_number

ARMS = ("compress", "copy")
RETUNE_GROWTH = 16  # the longest wait between periodic retunes, in ``retune``s (item 3)
# a close call (item 4): the other arm's shortest trial within this fraction above the chosen
# arm's settled median. Trial passes run in the tuner's first steps, where the other arm may
# still be warming: under FSDP2 on two H200s BERT-large's copied trials ran 288 and 495 ms
# against 249 ms copied steps, and the tuner kept compressing on a settled median close to
# 288, 1.14x a plain copy's step (``bench/results/h200_session64``)
CLOSE = 0.2
# a new workload (item 3): each of the last RECENT passes' bytes past DRIFT times the trial
# passes' median, or each below its 1 / DRIFT. With lengths drawn each pass from [seq / 4,
# seq], a median of 8 passes moved by up to 2x from one window to another (a rule on the
# last passes' median started the trials again in 3-5% of simulated runs); each of 8 passes
# past 1.5x that median is a chance of about 1e-9 there, and certain for a new length that
# stays
RECENT = 8
DRIFT = 1.5
# a pass at bytes no pass took before (item 6) is not timed, at most FRESH times per trials
# and per decision; SEEN amounts are remembered at most
FRESH, SEEN = 16, 4096
SPREAD = 1.1  # two passes give a slope (``time_shape``) when one took this many times the bytes


def pass_mark() -> float | torch.cuda.Event:
    """Now: a CUDA event on the current stream once CUDA is in use, else the host clock (s)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev
    return time.perf_counter()


def elapsed_ms(a, b) -> float | None:
    """Milliseconds from mark ``a`` to ``b``; None while either has not happened on the GPU
    yet, or -1.0 for marks that are not comparable: of different kinds (CUDA started between
    them), or events torch cannot time against each other (recorded on different devices).
    Never raises: a pass starts here (torch's ``elapsed_time`` raises unless both events are
    done, and ``a`` recorded on another stream, another pass's current one, may finish after
    ``b``; raised here, the step failed, and the mark stayed first in line for the next)."""
    if isinstance(a, torch.cuda.Event) and isinstance(b, torch.cuda.Event):
        if not (b.query() and a.query()):
            return None
        try:
            return a.elapsed_time(b)
        except RuntimeError:
            return -1.0
    if isinstance(a, float) and isinstance(b, float):
        return (b - a) * 1e3
    return -1.0


def time_shape(arms: list[list[tuple[float, int]]]) -> tuple[float, float]:
    """How a pass's time grows with its bytes, from passes ``(ms, bytes)`` grouped by arm:
    ``(fixed, power)``, a pass of ``b`` bytes taking ``fixed + c * b ** power`` ms (item 3 of
    the module docstring). Each arm's slope is the median of the slopes between two of its
    passes whose bytes differ by at least ``SPREAD`` (Theil-Sen: one slow pass moves
    neither), the part that does not grow with the bytes the median of ``ms - slope * bytes``
    over the passes of the arms that have one. Where that part is at least 0 (an optimizer
    step, launches), the rest grows as the bytes (``power`` 1; ``fixed`` at most 0.9 of the
    shortest pass, so that the part scaled stays positive); where it is below 0 the time
    grows faster than the bytes (attention's part, quadratic in the sequence's length), and
    ``power`` is the median of the pairs' ``log(ms2 / ms1) / log(b2 / b1)``, in [1, 2].
    ``(0.0, 1.0)``, time as the bytes, while no arm has two passes of different sizes."""
    fixed, powers = [], []
    for passes in arms:
        pairs = [(m1, b1, m2, b2) for i, (m1, b1) in enumerate(passes)
                 for m2, b2 in passes[i + 1:] if max(b1, b2) >= SPREAD * min(b1, b2)]
        if pairs:
            slope = statistics.median((m2 - m1) / (b2 - b1) for m1, b1, m2, b2 in pairs)
            fixed += [ms - slope * nbytes for ms, nbytes in passes]
            powers += [math.log(m2 / m1) / math.log(b2 / b1)
                       for m1, b1, m2, b2 in pairs if m1 > 0 and m2 > 0]
    if not fixed:
        return 0.0, 1.0
    part = statistics.median(fixed)
    if part >= 0:
        shortest = min(ms for passes in arms for ms, _ in passes)
        return min(part, 0.9 * shortest), 1.0
    return 0.0, min(max(statistics.median(powers), 1.0), 2.0) if powers else 1.0


class StepTuner:
    """Chooses, per pass, whether the hooks compress (``"compress"``) or copy (``"copy"``).

    ``clock`` returns a mark, ``elapsed`` the milliseconds between two (None: not yet known);
    tests pass a fake clock of floats (seconds)."""

    def __init__(self, warmup: int = 8, trials: int = 2, retune: int = 200,
                 margin: float = 0.03, clock: Callable[[], object] = pass_mark,
                 elapsed: Callable[[object, object], float | None] = elapsed_ms,
                 check: int = 4):
        for name, v, least in (("warmup", warmup, 0), ("trials", trials, 1),
                               ("retune", retune, 1), ("check", check, 0)):
            check_int(f"tuner: {name}", v, least)
        check_number("tuner: margin", margin)
        for name, fn in (("clock", clock), ("elapsed", elapsed)):
            if not callable(fn):
                raise ValueError(f"tuner: {name} must be callable, got {fn!r}")
        self.warmup, self.trials, self.retune, self.margin = warmup, trials, retune, margin
        self.check = check  # settled passes (after the first) that check a decision; 0: none
        self.clock, self.elapsed = clock, elapsed
        self.arm = "compress"  # of the pass in progress
        self.choice: str | None = None
        # (ms, bytes) of the timed trial passes of each arm, this trials
        self._trial_raw: dict[str, list[tuple[float, int]]] = {a: [] for a in ARMS}
        self.history: list[dict] = []  # one entry per decision
        self._warm = 0  # warm-up passes closed (with offloads)
        self._gen = 0  # trials generation: measurements of older ones are dropped
        self._schedule: list[tuple[str, bool]] = []  # trial (arm, timed?) still to hand out
        self._settled = 0  # passes handed the choice since the decision
        self._interval = retune  # settled passes before the next periodic retune
        self._kept: str | None = None  # the choice a periodic retune started from (None: the
        # trials in progress are not a periodic retune's)
        self._open: tuple | None = None  # (mark, arm, generation, trial?, settled?, the
        # schedule's item it took or None) of the pass in progress
        self._settled_raw: list[tuple[float, int]] = []  # (ms, bytes) of settled passes of
        # the choice, for its check
        self._checked = True  # the current decision was checked (or there is none)
        self._regrown = 0  # timed trial passes run again this trials (they made memory)
        self._untimed = 0  # timed trial passes run again this trials (they gave no time)
        self._seen: set[int] = set()  # the bytes passes have taken (item 6)
        self._refreshed = 0  # passes at bytes never seen, not timed, this trials / decision
        self._skipped = 0  # settled passes left out of this decision's check (the same)
        self._rival: tuple[str, list] | None = None  # (arm, its settled passes but the first,
        # as (ms, bytes)): checked first, lost to the other arm's trials; the other arm's
        # settled passes now decide
        self._bytes = 0  # offloaded by the pass in progress
        self._closed: collections.deque = collections.deque()  # passes awaiting their time
        self._recent: collections.deque = collections.deque(maxlen=RECENT)  # passes' bytes
        self._usual: float | None = None  # the trial passes' median bytes (once decided)
        self._span = (0, 0)  # their least and most bytes
        self._phase = "warmup" if warmup else "trial"
        if not warmup:
            self._begin_trials()

    def add_bytes(self, nbytes: int) -> None:
        """The pass in progress took ``nbytes`` more to offload (stored, or held and read in
        place: the workload, whatever the arm)."""
        self._bytes += nbytes

    def start_pass(self, grew: bool = False) -> str:
        """A pass begins: closes the previous one (``grew``: it made host memory, see the
        module docstring), reads the periods measured so far; returns this pass's arm."""
        now = self.clock()
        if self._open is not None and self._bytes == 0:
            # it offloaded nothing (evaluation): what it took is given back. Handed a trial
            # pass and never timed, the trials waited for it for good (compressing every
            # pass, whichever way was faster); counted as settled, evaluation batches
            # brought the next retune closer
            _, _, gen, _, settled, handed = self._open
            if handed is not None and gen == self._gen:
                self._schedule.insert(0, handed)
            elif settled:
                self._settled -= 1
        elif self._open is not None:
            start, arm, gen, trial, settled, _ = self._open
            fresh = self._fresh_bytes(self._bytes)
            if trial and (grew and self._regrown < 2 * self.trials
                          or fresh and self._refreshed < FRESH):
                if grew and self._regrown < 2 * self.trials:
                    self._regrown += 1
                else:
                    self._refreshed += 1
                self._schedule.insert(0, (arm, True))  # after a pass of its own, as before
                trial = False
            if settled and (grew and self._skipped < self.check
                            or fresh and self._refreshed < FRESH):
                if grew and self._skipped < self.check:
                    self._skipped += 1
                else:
                    self._refreshed += 1
                settled = False
            self._closed.append((start, arm, gen, trial, settled, self._bytes, now))
            if self._phase == "warmup":
                self._warm += 1
                if self._warm >= self.warmup:
                    self._begin_trials()
        # closed before reading the times: should ``elapsed`` raise, the next pass's start
        # does not close this one again (twice in line, with the bytes of both)
        self._open, self._bytes = None, 0
        self._measure()
        trial = settled = False
        handed = None  # the trial pass this pass takes from the schedule
        if self._schedule:
            handed = self._schedule.pop(0)
            self.arm, trial = handed
        elif self._phase == "settled":
            self._settled += 1
            self.arm, settled = self.choice, True
            if self._settled >= self._interval:
                self._begin_trials(kept=self.choice)
                settled = False
        else:
            self.arm = "compress"  # warm-up, or trials handed out and not measured yet
        self._open, self._bytes = (now, self.arm, self._gen, trial, settled, handed), 0
        return self.arm

    def _fresh_bytes(self, nbytes: int) -> bool:
        """Whether no pass before took ``nbytes`` (a new shape, most likely: item 6)."""
        if nbytes in self._seen:
            return False
        if len(self._seen) >= SEEN:  # bytes that never come back (not lengths): start over
            self._seen.clear()
        self._seen.add(nbytes)
        return True

    @property
    def checking(self) -> bool:
        """Whether the current decision still awaits its check (see the module docstring):
        until then the arm in force may change."""
        return self._phase != "settled" or not self._checked

    def _measure(self) -> None:
        while self._closed:
            start, arm, gen, trial, settled, nbytes, end = self._closed[0]
            ms = self.elapsed(start, end)
            if ms is None:
                return  # later ones end later
            self._closed.popleft()
            if gen != self._gen:
                continue
            if not ms > 0:  # no time (marks not comparable; NaN, 0 or less from a clock):
                # a timed trial pass runs again, after one of its arm, at most ``2 * trials``
                # times per trials (dropped, the trials waited for it for good, compressing
                # whichever way was faster; kept, a NaN or 0 ms decided for its arm)
                if trial and self._untimed < 2 * self.trials:
                    self._untimed += 1
                    self._schedule += [(arm, False), (arm, True)]
                continue
            self._recent.append(nbytes)
            if self._new_workload():
                self._begin_trials()  # a different workload: measure again
                continue
            if trial:
                self._trial_raw[arm].append((ms, nbytes))
                if sum(map(len, self._trial_raw.values())) == 2 * self.trials:
                    self._decide()
            elif settled and arm == self.choice and not self._checked:
                self._settled_raw.append((ms, nbytes))
                if len(self._settled_raw) > self.check:
                    self._check_settled()

    def _new_workload(self) -> bool:
        """Whether each of the last ``RECENT`` passes took more than ``DRIFT`` times the most
        bytes of a trial pass, or each less than the least over ``DRIFT`` (see item 3 of the
        module docstring)."""
        if self._usual is None or len(self._recent) < RECENT:
            return False
        least, most = self._span
        return min(self._recent) > most * DRIFT or max(self._recent) < least / DRIFT

    def _shape(self) -> tuple[float, float]:
        """:func:`time_shape` of the passes timed since the trials began: the trial passes,
        and the settled ones of the check (each arm's first left out)."""
        passes = {arm: list(v) for arm, v in self._trial_raw.items()}
        if self.choice is not None:
            passes[self.choice] += self._settled_raw[1:]
        if self._rival is not None:
            passes[self._rival[0]] += self._rival[1]
        return time_shape(list(passes.values()))

    def _at_usual(self, passes: list[tuple[float, int]],
                  shape: tuple[float, float]) -> list[float]:
        """Each pass's ms at the usual bytes, by ``shape`` (:func:`time_shape`)."""
        fixed, power = shape
        ref = self._ref_bytes() if passes else 0.0
        return [fixed + (ms - fixed) * (ref / nbytes) ** power for ms, nbytes in passes]

    def _ref_bytes(self) -> float:
        """The bytes a pass is compared at: the trial passes' median."""
        return self._usual if self._usual is not None else statistics.median(self._recent)

    @property
    def times(self) -> dict[str, list[float]]:
        """Each arm's timed trial passes (ms), at the usual bytes (item 3)."""
        shape = self._shape()
        return {a: self._at_usual(v, shape) for a, v in self._trial_raw.items()}

    @property
    def _settled_ms(self) -> list[float]:
        return self._at_usual(self._settled_raw, self._shape())

    def _begin_trials(self, kept: str | None = None) -> None:
        """Time both arms again (``kept``: the choice a periodic retune starts from)."""
        self._phase, self._gen, self._settled = "trial", self._gen + 1, 0
        # each arm's timed pass follows one of its own (see the module docstring)
        pairs = [(arm, timed) for arm in ("copy", "compress") for timed in (False, True)]
        self._schedule = pairs * self.trials
        self._trial_raw = {a: [] for a in ARMS}
        self._usual = None
        self._recent.clear()
        self._settled_raw, self._checked, self._rival = [], True, None
        self._regrown, self._kept, self._refreshed, self._untimed = 0, kept, 0, 0

    def _trial_best(self, shape: tuple[float, float] | None = None) -> dict:
        """Each arm's shortest timed trial pass (ms, at the usual bytes; ``shape``: the
        passes' :func:`time_shape`, where the caller has it)."""
        shape = self._shape() if shape is None else shape
        return {a: min(self._at_usual(v, shape)) for a, v in self._trial_raw.items()}

    def _choose(self, best: dict) -> str:
        faster = best["copy"] < best["compress"] * (1.0 - self.margin)
        return "copy" if faster else "compress"

    def _decide(self) -> None:
        self._usual = statistics.median(self._recent)
        self._span = (min(self._recent), max(self._recent))
        best = self._trial_best()
        self.choice = self._choose(best)
        self._phase, self._settled, self._skipped, self._refreshed = "settled", 0, 0, 0
        self._settled_raw, self._checked = [], False
        self.history.append({"choice": self.choice, "bytes_per_pass": round(self._ref_bytes()),
                             **{f"{a}_ms": round(best[a], 2) for a in ARMS}})
        if self.check == 0:
            self._final()

    def _final(self) -> None:
        """The decision is checked: a periodic retune that kept its choice waits twice as
        long for the next (at most ``RETUNE_GROWTH`` times ``retune``); otherwise the next
        comes after ``retune`` passes."""
        self._checked = True
        if self._kept is not None and self._kept == self.choice:
            self._interval = min(2 * self._interval, RETUNE_GROWTH * self.retune)
        else:
            self._interval = self.retune
        self._kept = None

    def _settled_holds(self, shape: tuple[float, float]) -> tuple[bool, dict]:
        """Whether the chosen arm's settled passes (the first left out) confirm it, set in
        place of its trial time against the other arm's shortest trial: it still wins there,
        and by more than ``CLOSE`` (else a close call); and the times so set (ms)."""
        median = statistics.median(self._at_usual(self._settled_raw[1:], shape))
        best = self._trial_best(shape)
        best[self.choice] = median
        other = "copy" if self.choice == "compress" else "compress"
        return self._choose(best) == self.choice and best[other] > median * (1.0 + CLOSE), best

    def _check_settled(self) -> None:
        """The chosen arm's settled passes in place of its trial time (:meth:`_settled_holds`):
        where they do not confirm it, the other arm's settled passes are measured too, and
        each arm's trial and settled passes together decide (see the module docstring)."""
        shape = self._shape()
        if self._rival is None:
            holds, best = self._settled_holds(shape)
            if holds:
                self._final()
                return
            self._rival = (self.choice, self._settled_raw[1:])
            # its settled passes are timed next
            verdict, arm = "measuring", "copy" if self.choice == "compress" else "compress"
        else:  # each arm's trial passes and settled ones together (item 4)
            best = {arm: statistics.median(self._at_usual(self._trial_raw[arm] + passes, shape))
                    for arm, passes in ((self._rival[0], self._rival[1]),
                                        (self.choice, self._settled_raw[1:]))}
            self._rival = None
            verdict, arm = "checked", self._choose(best)
        if arm != self.choice:
            self.choice, self._settled, self._settled_raw = arm, 0, []
        if verdict == "checked":
            self._final()
        self.history.append({"choice": arm, "bytes_per_pass": round(self._ref_bytes()),
                             verdict: True, **{f"{a}_ms": round(best[a], 2) for a in ARMS}})

    def summary(self) -> dict:
        """Phase, current arm and the decisions so far (for ``ActivationOffloader.stats``)."""
        return {"phase": self._phase, "arm": self.arm, "choice": self.choice,
                "retune_every": self._interval,
                "trial_ms": {a: [round(t, 2) for t in v] for a, v in self.times.items()},
                "settled_ms": [round(t, 2) for t in self._settled_ms],
                "decisions": self.history[-4:]}
