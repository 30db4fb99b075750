"""Probe (issue #21): the compressed offload's policies and GPU buffers, A/B on stock models.

Each policy is the package with one thing changed (patched in the child before the model is
built), against ``shipped``:

* ``keep``: finished offloads stay on the GPU until backward (released during a forward only
  when the in-flight bound forces it), as the plain copy's late copies do; measured at 193cacc
  (``bench/results/h200x2_193cacc/``): 7-8% faster on the host-bound models, 0.1-0.2 GiB more
  GPU peak.
* ``slice32`` / ``slice16``: slices of 32 / 16 MiB instead of 64 (the compress kernel's
  fixed-stride payload shrinks; a large tensor takes more launches).
* ``scratch2``: two slices' payloads, the compress a slice ahead of the pack stream (one
  since session 55).
* ``restore32``: batched restores stage at most 32 MiB instead of 64.

Under FSDP2 (``bench/results/h100x2_fsdp_4ecd9ac/``) ``prefer="memory"`` peaked 0.2-0.4 GiB
above uncompressed offload, about its fixed GPU buffers (0.14 GiB of compress scratch, up to
64 MiB of restore staging): these policies say what each buffer buys.

Each (model, variant, policy) runs in its own child (``bench.stock_models.run``, the same
steps, timing and gradient hash as the stock bench). Prints one table: step ms, host issue ms,
peak GPU GiB, the forward's and the backward's peaks (``phase_gib``), storages served in place,
restored ahead and on demand, in-flight waits, per step.

    python -m bench.dev_offload_policy --models encoder-1024 --policies shipped,slice16
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

from bench.children import cell, md_table, run_child, write_results

POLICIES = ("shipped", "keep", "slice32", "slice16", "scratch2", "restore32")
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


def store_args(**kw) -> None:
    """Patch the compressed store: made with ``kw`` (``slice_bytes``) unless given."""
    from torch_pagecomp.offload import _paged

    init = _paged.PagedStore.__init__

    def patched(self, *args, **kwargs):
        for key, value in kw.items():
            kwargs.setdefault(key, value)
        init(self, *args, **kwargs)

    _paged.PagedStore.__init__ = patched


def apply(policy: str) -> None:
    """Patch the package for ``policy`` (see the module docstring)."""
    from torch_pagecomp.offload import _backward, _paged

    if policy == "keep":
        keep_finished_offloads()
    elif policy in ("slice32", "slice16"):
        store_args(slice_bytes=int(policy[5:]) << 20)
    elif policy == "scratch2":
        _paged.SCRATCH_SLICES = 2
    elif policy == "restore32":
        _backward.RESTORE_BATCH_BYTES = 32 << 20
    elif policy != "shipped":
        raise ValueError(f"unknown policy {policy!r}; one of {POLICIES}")


def child(model: str, variant: str, policy: str, steps: int, warmup: int, device: str) -> dict:
    apply(policy)
    from bench.stock_models import run

    row = run(model, variant, steps, warmup, device, False)
    row["policy"] = policy
    return row


def table(rows: list[dict]) -> str:
    head = ["model", "variant", "policy", "step ms", "host issue ms", "peak GPU GiB",
            "fwd / bwd peak GiB", "served in place", "restored ahead", "restored on demand",
            "in-flight waits", "grads"]
    body = []
    for r in rows:
        first = [r["model"], r["variant"], str(r.get("policy"))]
        if "error" in r:
            body.append(first + [f"error: {r['error']}"])
            continue
        st = r.get("stats", {})
        phases = r.get("phase_gib")
        split = (f"{cell(max(p[0] for p in phases))} / {cell(max(p[2] for p in phases))}"
                 if phases else "")
        body.append(first + [f"{r['step_ms']:.1f}", cell(r.get("host_issue_ms"), 1),
                             cell(r.get("peak_gpu_gib")), split]
                    + [cell(st.get(k, 0), 1) for k in COUNTS] + [str(r.get("grads"))[:12]])
    return md_table(head, body)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="encoder-1024,llama-2048")
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
                if p != "shipped" and v not in ("memory", "speed"):
                    continue  # the policies change the compressed path only
                row = run_child("bench.dev_offload_policy",
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
