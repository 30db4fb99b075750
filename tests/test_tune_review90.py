"""``prefer="speed"``'s tuner (``_tune.StepTuner``): passes that offload nothing, passes that
give no time, and marks that torch cannot time against each other (review 90).

Fake clocks throughout; the hooks' side on the CPU path (``offload_cpu=True``).
"""

from __future__ import annotations

import math

import pytest
import torch

from bench.dev_tuner_sim import FakeClock
from tests.test_offload import GPT, assert_identical, cpu_offloader, grads_of
from torch_pagecomp import StepTuner
from torch_pagecomp.offload import _tune

MS = {"compress": 200.0, "copy": 100.0}  # copying twice as fast


def step(tuner: StepTuner, clock: FakeClock, ms: dict, nbytes: int = 1 << 20) -> str:
    arm = tuner.start_pass()
    tuner.add_bytes(nbytes)
    clock.advance(ms[arm])
    return arm


@pytest.mark.parametrize("trials", [1, 2])
@pytest.mark.parametrize("evals", [1, 3, 12])
def test_passes_without_offloads_during_the_trials_do_not_stall_them(trials, evals):
    """An evaluation pass (``torch.no_grad()``: nothing saved, nothing offloaded) between the
    trial passes took a trial pass from the schedule and was never timed: the trials waited
    for it for good and every later pass compressed, at twice the copied step here. Wherever
    the evaluation passes fall (a validation loop longer than the trials included), the
    trial passes they took run after them and the tuner copies."""
    for at in range(4 * trials):  # the evaluation passes start at each trial pass
        clock = FakeClock()
        tuner = StepTuner(warmup=1, trials=trials, retune=1000, check=2, clock=clock)
        arms = [step(tuner, clock, MS)]  # warm-up
        for _ in range(at):
            arms.append(step(tuner, clock, MS))
        for _ in range(evals):
            tuner.start_pass()  # nothing offloaded
            clock.advance(30.0)
        for _ in range(4 * trials + 12):
            arms.append(step(tuner, clock, MS))
        assert tuner.choice == "copy" and not tuner.checking, (at, arms, tuner.summary())
        assert arms[-6:] == ["copy"] * 6, (at, arms)
        # the trial passes all ran, each arm's timed ones at its own time
        assert tuner.history[0]["copy_ms"] == pytest.approx(100.0)
        assert tuner.history[0]["compress_ms"] == pytest.approx(200.0)


def test_passes_without_offloads_do_not_bring_the_retune_closer():
    """Settled, an evaluation loop of more passes than ``retune`` started the periodic
    retune (trial passes that pin the other way's memory again: seconds on an H200): the
    docstring's passes that offload nothing change nothing."""
    clock = FakeClock()
    tuner = StepTuner(warmup=0, trials=1, retune=10, check=0, clock=clock)
    arms = [step(tuner, clock, MS) for _ in range(4 + 3)]  # trials, then 3 settled passes
    assert arms[4:] == ["copy"] * 3 and tuner.choice == "copy"
    for _ in range(25):  # a validation loop
        assert tuner.start_pass() == "copy"
        clock.advance(5.0)
    arms = [step(tuner, clock, MS) for _ in range(6)]  # settled passes 4 to 9 of 10
    assert arms == ["copy"] * 6 and tuner.summary()["phase"] == "settled", tuner.summary()
    # the tenth starts the retune, whose trials follow it
    arms = [step(tuner, clock, MS) for _ in range(4)]
    assert arms == ["copy", "copy", "copy", "compress"], arms


def test_hooks_tuner_decides_with_an_evaluation_loop_in_the_trials(seed):
    """Through the hooks (CPU path): a validation loop (forwards under ``torch.no_grad()``
    inside the offloader) after the first trial step. Each of its forwards took a trial pass:
    the tuner never decided and compressed every step, where copying ran twice as fast."""
    clock = FakeClock()
    tuner = StepTuner(warmup=1, trials=1, retune=100, check=1, clock=clock)
    model = GPT(d=32, heads=4, layers=2)
    x = torch.randn(2, 23, 32)
    ref = grads_of(model, x)
    off = cpu_offloader("compressed", prefer="speed", tuner=tuner, min_ratio=0.0)
    arms = []
    for k in range(12):
        assert_identical(ref, grads_of(model, x, off))
        arms.append(tuner.summary()["arm"])
        clock.advance(50.0 if arms[-1] == "copy" else 100.0)
        if k == 1:  # the warm-up step, then the copied trial's first
            for _ in range(4):
                with off, torch.no_grad():  # evaluation: nothing saved
                    model(x)
                clock.advance(5.0)
    assert tuner.choice == "copy" and not tuner.checking, (arms, tuner.summary())
    assert arms[-4:] == ["copy"] * 4, arms


class IndexClock(FakeClock):
    """Marks ``(pass index, seconds)``; ``elapsed`` gives ``bad`` for the pass ``target``."""

    def __init__(self, bad: float):
        super().__init__()
        self.n, self.bad, self.target = -1, bad, None

    def __call__(self):
        self.n += 1
        return (self.n, self.t)

    def elapsed(self, a, b):
        return self.bad if a[0] == self.target else (b[1] - a[1]) * 1e3


@pytest.mark.parametrize(("bad", "faster"), [(-1.0, "copy"), (math.nan, "copy"),
                                             (0.0, "compress")])
def test_a_timed_trial_pass_that_gave_no_time_runs_again(bad, faster):
    """A timed trial pass whose period is no time: -1 (``elapsed_ms``: marks not comparable,
    CUDA started between them) was dropped, and the trials waited for it for good,
    compressing every pass; NaN or 0 ms was kept, and decided (a NaN never wins a
    comparison: compressing; 0 ms always does). The pass runs again, after one of its arm."""
    clock = IndexClock(bad)
    tuner = StepTuner(warmup=1, trials=1, retune=1000, check=0, clock=clock,
                      elapsed=clock.elapsed)
    ms = {faster: 100.0, ("copy" if faster == "compress" else "compress"): 200.0}
    arms = []
    for _ in range(16):
        arms.append(step(tuner, clock, ms))
        if clock.target is None and tuner._open[3] and arms[-1] == "copy":
            clock.target = clock.n  # the first timed trial pass of copying
    assert clock.target is not None
    assert tuner.choice == faster and not tuner.checking, (arms, tuner.summary())
    assert arms[-6:] == [faster] * 6, arms
    assert all(math.isfinite(v) for v in tuner.history[0].values() if isinstance(v, float))


class FakeEvent:
    """``torch.cuda.Event`` as ``elapsed_ms`` reads it: ``elapsed_time`` raises as torch's
    does unless both events are done, and for events of different devices."""

    def __init__(self, ms: float, done: bool = True, device: int = 0):
        self.ms, self.done, self.device = ms, done, device

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, other: FakeEvent) -> float:
        if not (self.query() and other.query()):
            raise RuntimeError("Both events must be completed before calculating elapsed time.")
        if self.device != other.device:
            raise RuntimeError("CUDA error: invalid resource handle")
        return other.ms - self.ms


def test_elapsed_ms_never_raises(monkeypatch):
    """``elapsed_ms`` queried only the later mark: one recorded on another stream (another
    pass's current stream) and not done yet made torch's ``elapsed_time`` raise, and events
    of two devices cannot be timed against each other. A pass's start (the hooks'
    ``__enter__``) raised: the step failed."""
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    assert _tune.elapsed_ms(FakeEvent(1.0), FakeEvent(3.5)) == pytest.approx(2.5)
    assert _tune.elapsed_ms(FakeEvent(1.0, done=False), FakeEvent(3.5)) is None
    assert _tune.elapsed_ms(FakeEvent(1.0), FakeEvent(3.5, done=False)) is None
    assert _tune.elapsed_ms(FakeEvent(1.0), FakeEvent(3.5, device=1)) == -1.0
    assert _tune.elapsed_ms(1.0, FakeEvent(3.5)) == -1.0


def test_tuner_on_events_of_another_stream_and_device_decides(monkeypatch):
    """The default ``elapsed`` on events: a trial pass starts on a stream that finishes late
    (its mark done two passes later), another on a second device. No pass's start raises,
    and the tuner copies (the faster way); the pass across devices runs again."""
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    clock = FakeClock()
    marks = []

    def mark():
        n = len(marks)
        # pass 2 (the copied trial's timed pass) on a late stream, pass 4 (the compressed
        # trial's timed pass) on another device: both arms' first timed passes
        ev = FakeEvent(clock.t * 1e3, done=n != 2, device=1 if n == 4 else 0)
        marks.append(ev)
        return ev

    tuner = StepTuner(warmup=1, trials=1, retune=1000, check=2, clock=mark)
    arms = []
    for k in range(20):
        arms.append(step(tuner, clock, MS))
        if k == 4:
            marks[2].done = True  # the late stream is done
    assert tuner.choice == "copy" and not tuner.checking, (arms, tuner.summary())
    assert arms[-6:] == ["copy"] * 6, arms
    assert tuner.history[0]["copy_ms"] == pytest.approx(100.0)
    assert tuner.history[0]["compress_ms"] == pytest.approx(200.0)


def test_a_pass_whose_times_raised_is_closed_once():
    """``elapsed`` raising at a pass's start (the step fails there) left that pass open: the
    next start closed it again, a second trial pass of its arm with the bytes of both, and
    the decision then took the shortest of no passes of the other arm (``ValueError``), the
    trials never ending. The pass is closed before the times are read."""
    clock = FakeClock()
    calls = []

    def elapsed(a, b):
        calls.append((a, b))
        if len(calls) == 3:  # the copied trial's timed pass, read at the next start
            raise RuntimeError("a failing read")
        return (b - a) * 1e3

    tuner = StepTuner(warmup=1, trials=1, retune=1000, check=0, clock=clock, elapsed=elapsed)
    arms = []
    for _ in range(12):
        try:
            arms.append(step(tuner, clock, MS))
        except RuntimeError:
            clock.advance(10.0)  # the step failed at its start: the next one
    assert len(calls) >= 3 and arms[:3] == ["compress", "copy", "copy"], arms
    assert tuner.choice == "copy" and not tuner.checking, (arms, tuner.summary())
    assert arms[-4:] == ["copy"] * 4, arms
