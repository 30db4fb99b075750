"""Dev probe: the offload hooks' stream ordering under random GPU delays (the T5 crash hunt).

``python3 -m bench.dev_chaos --models t5-1024 --arms uncompressed,memory,speed --steps 20``
(GPU): one stock model (``bench.stock_models.build``), its gradients without offload taken
twice as the reference (deterministic settings, SDPA's math kernel, as
``bench.dev_ab_steps``' check), then ``--steps`` rounds of one step per arm, each on the
arm's own offloader (kept across steps, as a training loop keeps it), **with random delays
on the package's streams**: wherever the package switches to a stream (``_streams.on_stream``)
or records an event (``_events.mark``) or hands work from one stream to another
(``_events.handoff``: a delay on the producer), with probability ``--prob`` a ``torch.cuda._sleep``
of up to ``--max-us`` microseconds is queued there first (on the stream it switches to, or
from, or records on). A missing wait between streams (a copy or kernel reading what its
producer has not finished, memory reused while a side stream still reads it) then shows as
gradients that differ from the reference, or as a CUDA error, far more often than at normal
timing (session 69's illegal memory access: one T5 process in 22). No optimizer step: every
step's gradients must equal the reference bit for bit. Prints one line per step that
differs and a summary; exits 1 on any difference.

``--fresh N``: each arm's offloader made anew every N rounds, so the first steps' paths
(arena chunks pinned while kernels run, kernels launched for the first time) recur.
``--sdpa default``: the model's own attention kernels (the timed benches' path) instead of
the math kernel; then the reference is compared only where two reference steps agreed.
``--control``: the package's hand-offs (a side stream waiting for the producer's work) do
nothing while delays run: the gradients must then differ, or the probe could not see a race.
``--device cpu``: a smoke run on a tiny model (no delays: ``_sleep`` is CUDA's).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
import time

CLOCK_HZ = 1.98e9  # an H200's SM clock at load: ``_sleep`` counts cycles


class Chaos:
    """Random ``torch.cuda._sleep`` delays queued where the package switches streams or
    records events, while entered (see the module docstring). ``delays``: how many were
    queued."""

    def __init__(self, prob: float, max_us: float, seed: int, control: bool = False):
        self.prob, self.max_cycles = prob, int(max_us * 1e-6 * CLOCK_HZ)
        self.control = control  # hand-offs dropped: the probe's control, which must fail
        self.rng = random.Random(seed)
        self.delays = 0
        self._undo: list = []

    def _delay(self, stream) -> None:
        import torch

        if stream is None or self.rng.random() >= self.prob:
            return
        if torch.cuda.is_current_stream_capturing():
            return
        with torch.cuda.stream(stream):
            torch.cuda._sleep(self.rng.randrange(1, self.max_cycles))
        self.delays += 1

    def __enter__(self) -> Chaos:
        import torch

        from bench.dev_hook_timing import rebind_imported
        from torch_pagecomp import _events
        from torch_pagecomp.offload import _streams

        chaos = self
        real_enter = _streams.on_stream.__enter__
        real_mark, real_handoff = _events.mark, _events.handoff

        def enter(self_):
            if self_.stream is not None:
                chaos._delay(torch.cuda.current_stream(self_.stream.device))  # the one left
                chaos._delay(self_.stream)  # the one switched to
            return real_enter(self_)

        def mark(stream):
            chaos._delay(stream)
            return real_mark(stream)

        def handoff(before, after):
            chaos._delay(before)  # the producer runs late
            if not chaos.control:
                real_handoff(before, after)

        self._undo.append((_streams.on_stream, "__enter__", real_enter))
        _streams.on_stream.__enter__ = enter
        # ``mark`` and ``handoff`` are imported by name into the package's modules
        self._undo += rebind_imported("mark", real_mark, mark)
        self._undo += rebind_imported("handoff", real_handoff, handoff)
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, real in reversed(self._undo):
            setattr(owner, name, real)
        self._undo.clear()


def run(name: str, arms: list[str], steps: int, device: str, chaos: Chaos | None,
        sdpa: str = "math", budget_s: float | None = None,
        fresh: int | None = None) -> tuple[int, list[str]]:
    """``steps`` rounds of one step per arm on model ``name``, each step's gradient hashes set
    against the reference; ``(steps that differed, report lines)``. ``fresh``: every that
    many rounds each arm's offloader is closed and a new one made (its arena grows again:
    chunks pinned while kernels run, as in a process's first steps)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from bench.dev_ab_steps import _hooked
    from bench.stock_models import _grad_hash, build, variant_settings
    from torch_pagecomp import ActivationOffloader

    cuda = device == "cuda"
    model, x, blocks = build(name, device)

    def make() -> dict:
        return {a: ActivationOffloader(**variant_settings(a, device)) for a in arms}

    offs = make()
    kernel = sdpa_kernel(SDPBackend.MATH) if sdpa == "math" else contextlib.nullcontext()
    lines, bad, start = [], 0, time.monotonic()

    def grads(off) -> list[int]:
        with _hooked(model, blocks, off):
            model.zero_grad(set_to_none=True)
            model(x).float().square().mean().backward()
        return _grad_hash(model)

    torch.use_deterministic_algorithms(sdpa == "math", warn_only=True)
    try:
        with kernel:
            ref = grads(None)
            exact = grads(None) == ref
            if not any(ref):
                lines.append(f"{name}: all-zero gradients, nothing to compare")
                exact = False
            done = 0
            for step in range(steps):
                if budget_s is not None and time.monotonic() - start > budget_s:
                    break
                if fresh and step and step % fresh == 0:
                    for off in offs.values():
                        off.close()
                    offs = make()
                for arm in (arms[step % len(arms):] + arms[:step % len(arms)]):
                    print(f"[chaos] {name} {arm} step {step}", file=sys.stderr, flush=True)
                    with chaos if chaos is not None else contextlib.nullcontext():
                        got = grads(offs[arm])
                        if cuda:
                            torch.cuda.synchronize()
                    if exact and got != ref:
                        bad += 1
                        diff = sum(a != b for a, b in zip(got, ref))
                        lines.append(f"{name} {arm} step {step}: {diff} of {len(ref)} "
                                     "gradients differ from no offload")
                done = step + 1
    finally:
        torch.use_deterministic_algorithms(False)
        for off in offs.values():
            off.close()
    delays = chaos.delays if chaos is not None else 0
    lines.append(f"{name}: {done} rounds of {', '.join(arms)}, {delays} delays queued, "
                 f"{bad} steps differed" + ("" if exact else " (reference not exact: "
                                           "compared nothing)"))
    return bad, lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="t5-1024")
    ap.add_argument("--arms", default="uncompressed,memory,speed")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prob", type=float, default=0.02,
                    help="chance of a delay at each stream switch or event")
    ap.add_argument("--max-us", type=float, default=1000.0, help="longest delay, us")
    ap.add_argument("--seed", type=int, default=None, help="the delays' seed (default: time)")
    ap.add_argument("--sdpa", choices=("math", "default"), default="math")
    ap.add_argument("--budget", type=float, default=None, help="seconds per model, at most")
    ap.add_argument("--fresh", type=int, default=None,
                    help="new offloaders every that many rounds (their arenas grow again)")
    ap.add_argument("--control", action="store_true",
                    help="the control: hand-offs to side streams dropped (must show differences)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None)
    args = ap.parse_args()
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    seed = args.seed if args.seed is not None else time.time_ns() % (1 << 31)
    print(f"seed {seed}, prob {args.prob}, max {args.max_us} us, sdpa {args.sdpa}", flush=True)
    bad = 0
    for name in args.models.split(","):
        chaos = (Chaos(args.prob, args.max_us, seed, args.control) if device == "cuda"
                 else None)
        n, lines = run(name, args.arms.split(","), args.steps, device, chaos, args.sdpa,
                       args.budget, args.fresh)
        bad += n
        print("\n".join(lines), flush=True)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
