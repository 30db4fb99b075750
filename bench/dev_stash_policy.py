"""Probe (issue #21): does keeping finished offloads on the GPU until backward pay?

The stock runs' own counters (``bench/results/h200x2_72948eb/``) show where the plain copy's
speed comes from: its copies are slow to finish, so at the end of a forward most of the newest
storages are still in the offloader's stash and backward uses them in place (resnet-64: 55.8
of 62 per step), while compression finishes sooner, releases them (a lower GPU peak) and then
restores 57. Policy ``keep`` releases a finished offload's GPU storage during a forward only
when the in-flight bound (``max_in_flight_bytes``) forces it, so the newest ones stay for
backward as the plain copy's do; ``shipped`` is the package as it is. The GPU peak of ``keep``
should stay at or below uncompressed offload's (the same bound holds both).

Each (model, variant, policy) runs in its own child (``bench.stock_models.run``, the same
steps, timing and gradient hash as the stock bench). Prints one table: step ms, host issue
ms, peak GPU GiB, storages served in place, restored ahead and on demand, per step.

    python -m bench.dev_stash_policy --models encoder-1024,resnet-64 --variants uncompressed,memory
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

from bench.children import cell, md_table, run_child, write_results

POLICIES = ("shipped", "keep")
COUNTS = ("served_from_stash", "restored_prefetch", "restored_on_demand", "in_flight_waits")


def keep_finished_offloads() -> None:
    """Patch the offloader: in a forward, its poll sees no stash (nothing is released because
    it finished); the in-flight bound in ``_offload`` still releases the oldest under pressure,
    and backward polls as shipped."""
    from torch_pagecomp.offload._entry import _in_backward
    from torch_pagecomp.offload._hooks import ActivationOffloader

    shipped = ActivationOffloader._poll

    def poll(self):
        if _in_backward():
            return shipped(self)
        stash, self._stash = self._stash, collections.deque()
        try:
            shipped(self)
        finally:
            self._stash = stash

    ActivationOffloader._poll = poll


def child(model: str, variant: str, policy: str, steps: int, warmup: int, device: str) -> dict:
    if policy == "keep":
        keep_finished_offloads()
    from bench.stock_models import run

    row = run(model, variant, steps, warmup, device, False)
    row["policy"] = policy
    return row


def table(rows: list[dict]) -> str:
    head = ["model", "variant", "policy", "step ms", "host issue ms", "peak GPU GiB",
            "served in place", "restored ahead", "restored on demand", "in-flight waits",
            "grads"]
    body = []
    for r in rows:
        first = [r["model"], r["variant"], str(r.get("policy"))]
        if "error" in r:
            body.append(first + [f"error: {r['error']}"])
            continue
        st = r.get("stats", {})
        body.append(first + [f"{r['step_ms']:.1f}", cell(r.get("host_issue_ms"), 1),
                             cell(r.get("peak_gpu_gib"))]
                    + [cell(st.get(k, 0), 1) for k in COUNTS] + [str(r.get("grads"))[:12]])
    return md_table(head, body)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="encoder-1024,resnet-64")
    ap.add_argument("--variants", default="uncompressed,memory")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--timeout", type=int, default=240)
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", nargs=3, metavar=("MODEL", "VARIANT", "POLICY"))
    args = ap.parse_args(argv)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # as the stock bench
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.child:
        print(json.dumps(child(*args.child, args.steps, args.warmup, device)))
        return 0
    rows = []
    for m in args.models.split(","):
        for v in args.variants.split(","):
            for p in args.policies.split(","):
                row = run_child("bench.dev_stash_policy",
                                ["--child", m, v, p, "--steps", str(args.steps), "--warmup",
                                 str(args.warmup), "--device", device],
                                {"model": m, "variant": v, "policy": p}, args.timeout)
                row.setdefault("policy", p)
                rows.append(row)
                print(table(rows).splitlines()[-1], file=sys.stderr, flush=True)
    text = table(rows)
    print(text)
    write_results({"commit": os.environ.get("PAGECOMP_COMMIT", "unknown"), "device":
                   torch.cuda.get_device_name() if device == "cuda" else "cpu", "rows": rows},
                  args.out, text)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
