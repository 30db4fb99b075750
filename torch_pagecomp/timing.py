"""Per-batch stage timing of the pipeline: what each stage took and which one bounds it.

Times are milliseconds from the pipeline's epoch (a CUDA event recorded when it was built, or
the ``perf_counter`` at construction on the CPU path), so batches of different slots can be
laid on one timeline and their overlap seen.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import asdict, dataclass

STAGES = ("upload", "kernel", "download")


@dataclass(frozen=True)
class BatchTiming:
    """One batch: ``kind`` ("offload" or "restore"), its slot, bytes, stage intervals (ms).

    Host times (``perf_counter`` ms from the log's epoch; -1 when not known): ``submitted``,
    when the caller's thread had queued the batch; ``issued``, when the issuer thread had
    queued its download; ``noticed``, when the completer thread saw it complete. On a GPU the
    stages are CUDA event times from an epoch event recorded at about the same moment, so the
    two clocks agree only roughly: enough to see a thread that acted late against a GPU that
    was idle.
    """

    kind: str
    slot: int
    nbytes: int
    stored: int
    upload: tuple[float, float]
    kernel: tuple[float, float]
    download: tuple[float, float]
    submitted: float = -1.0
    issued: float = -1.0
    noticed: float = -1.0

    @property
    def upload_ms(self) -> float:
        return self.upload[1] - self.upload[0]

    @property
    def kernel_ms(self) -> float:
        return self.kernel[1] - self.kernel[0]

    @property
    def download_ms(self) -> float:
        return self.download[1] - self.download[0]

    @property
    def total_ms(self) -> float:
        return max(self.upload[1], self.kernel[1], self.download[1]) - self.upload[0]

    @property
    def gbps(self) -> float:
        """Uncompressed bytes over the batch's own span (upload start to last stage end)."""
        return self.nbytes / self.total_ms / 1e6 if self.total_ms > 0 else float("inf")

    @property
    def ratio(self) -> float:
        return self.nbytes / self.stored if self.stored else 1.0

    @property
    def bound(self) -> str:
        """The stage that took longest: the one that limits a full pipeline."""
        spans = {"upload": self.upload_ms, "kernel": self.kernel_ms, "download": self.download_ms}
        return max(spans, key=spans.get)

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(
            upload_ms=self.upload_ms,
            kernel_ms=self.kernel_ms,
            download_ms=self.download_ms,
            total_ms=self.total_ms,
            gbps=self.gbps,
            ratio=self.ratio,
            bound=self.bound,
        )
        return d


class TimingLog:
    """Running sums per kind and the last ``keep`` batches (the timeline). Thread-safe."""

    def __init__(self, keep: int = 4096):
        self.epoch = time.perf_counter()
        self.recent: deque[BatchTiming] = deque(maxlen=keep)
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.recent.clear()
            self.sums = {
                k: {"batches": 0, "bytes": 0, "stored": 0, "upload_ms": 0.0, "kernel_ms": 0.0,
                    "download_ms": 0.0, "total_ms": 0.0, "bound": dict.fromkeys(STAGES, 0)}
                for k in ("offload", "restore")
            }

    def add(self, t: BatchTiming) -> None:
        with self._lock:
            self.recent.append(t)
            s = self.sums[t.kind]
            s["batches"] += 1
            s["bytes"] += t.nbytes
            s["stored"] += t.stored
            s["upload_ms"] += t.upload_ms
            s["kernel_ms"] += t.kernel_ms
            s["download_ms"] += t.download_ms
            s["total_ms"] += t.total_ms
            s["bound"][t.bound] += 1

    def host_ms(self, t: float) -> float:
        """``perf_counter`` seconds ``t`` as ms from this log's epoch."""
        return (t - self.epoch) * 1e3

    def add_cpu(self, kind, slot, nbytes, stored, u0, u1, k0, k1, d0=None, d1=None,
                submitted=-1.0) -> None:
        """Record a CPU-path batch from ``perf_counter`` seconds (``submitted``: host ms)."""
        d0 = k1 if d0 is None else d0
        d1 = k1 if d1 is None else d1

        def ms(a: float, b: float) -> tuple[float, float]:
            return (self.host_ms(a), self.host_ms(b))

        self.add(BatchTiming(kind, slot, nbytes, stored, ms(u0, u1), ms(k0, k1), ms(d0, d1),
                             submitted))

    def summary(self) -> dict:
        with self._lock:
            return {k: {**v, "bound": dict(v["bound"])} for k, v in self.sums.items()}

    def timeline(self, last: int | None = None) -> list[dict]:
        """The recent batches (the ``last`` ones when given), oldest first, as dicts."""
        with self._lock:
            recent = list(self.recent)
        return [t.as_dict() for t in (recent if last is None else recent[-last:])]


def overlapping_slots(timeline: list[dict], window: int = 64) -> int:
    """How many pairs of batches in different slots (each against its next ``window``) had two
    different stages running at once (e.g. one slot's download during another's kernel):
    evidence that the ring overlaps."""
    count = 0
    for i, a in enumerate(timeline):
        for b in timeline[i + 1 : i + 1 + window]:
            if a["slot"] == b["slot"]:
                continue
            for sa in STAGES:
                for sb in STAGES:
                    if sa == sb:
                        continue
                    (a0, a1), (b0, b1) = a[sa], b[sb]
                    if a1 > a0 and b1 > b0 and min(a1, b1) > max(a0, b0):
                        count += 1
    return count
