"""Dev probe: the activation-offload hooks' host time per call, without cProfile's inflation.

``python3 -m bench.dev_hook_timing --models encoder-1024,resnet-64 --variants uncompressed,memory``
(GPU; ``memory_lz4``: ``memory`` with ``codec="lz4"``; ``speed`` too, timed once its tuner
has chosen, and ``speed_copy_only``, its code path with every pass copied from the first:
``bench.stock_models.CopyOnlyTuner``): for each model and variant, a
few warm steps, then ``--steps`` steps with the package's hot functions wrapped in
``perf_counter_ns`` timers (inclusive time: a wrapped function's time includes the wrapped
functions it calls). Prints, per function, calls per step, host ms per step and host us per
call, beside the step's host issue time with and without the timers (their own cost is one call
to ``perf_counter_ns`` on entry and exit).
"""

from __future__ import annotations

import argparse
import collections
import functools
import gc
import importlib
import statistics
import sys
import time

TARGETS = (
    "torch_pagecomp.offload._hooks:ActivationOffloader._pack",
    "torch_pagecomp.offload._hooks:ActivationOffloader._offload",
    "torch_pagecomp.offload._hooks:ActivationOffloader._keep_reason",
    "torch_pagecomp.offload._hooks:ActivationOffloader._poll",
    "torch_pagecomp.offload._backward:Backward.unpack",
    "torch_pagecomp.offload._backward:Backward.restore",
    "torch_pagecomp.offload._paged:PagedStore.offload",
    "torch_pagecomp.offload._paged:PagedStore._store_slice",
    "torch_pagecomp.offload._paged:PagedStore.restore",
    "torch_pagecomp.offload._backward:Backward.restore_batch",
    "torch_pagecomp.offload._paged_group:restore_group",
    "torch_pagecomp.offload._paged_group:restore_placed",
    "torch_pagecomp.offload._paged_group:_absorb",
    "torch_pagecomp.offload._decode:_row_table",
    "torch_pagecomp.offload._decode:to_device",
    "torch_pagecomp.offload._copies:copy_spans",
    "torch_pagecomp.offload._arena:slice_meta",
    "torch_pagecomp.offload._arena:VirtualArena.spans",
    "torch_pagecomp.offload._backward:Backward._restore_one",
    "torch_pagecomp.offload._hooks:ActivationOffloader._release",
    "torch_pagecomp.offload._paged:PagedStore.poll",
    "torch_pagecomp.offload._decode:_decompress_rows",
    "torch_pagecomp.kernels.lz4_decompress:decompress_rows",
    "torch_pagecomp.offload._arena:VirtualArena.back",
    "torch_pagecomp.offload._arena:VirtualArena.confirm",
    "torch_pagecomp.offload._stores:PinnedStore.offload",
    "torch_pagecomp.offload._stores:PinnedStore.restore",
    "torch_pagecomp.offload._ledger:HostLedger.add",
    "torch_pagecomp.offload._ledger:HostLedger.settle",
    "torch_pagecomp.kernels.lz4_compress:compress_pages",
    "torch_pagecomp.kernels.lz4_decompress:decompress_into",
    "torch_pagecomp.kernels.exp_codec:compress_exp_pages",
    "torch_pagecomp.kernels.exp_codec:decompress_exp_rows",
    "torch_pagecomp.kernels.exp_codec:decompress_exp_into",
    "torch_pagecomp.kernels.host_pack:pack_slice",
    "torch_pagecomp.kernels.launch:_launch_compiled",
    "torch_pagecomp.kernels.launch:launch_known",
    "torch_pagecomp.kernels.row_table:fill_row_table_at",
    "torch_pagecomp.kernels.exp_codec:decompress_exp_rows_known",
    "torch_pagecomp.kernels.exp_codec:decompress_exp_into_known",
    "torch_pagecomp.offload._arena:UploadRing.put",
    "torch_pagecomp.offload._arena:UploadRing.put_addr",
    "torch_pagecomp.kernels.exp_codec:compress_exp_placed_at",
    "torch_pagecomp.kernels.lz4_compress:compress_at",
    "torch_pagecomp.kernels.host_pack:pack_slice_at",
    "torch_pagecomp.kernels.row_table:gather_slice_meta_at",
    "torch_pagecomp.kernels.lz4_decompress:decompress_rows_at",
    "torch_pagecomp.kernels.exp_codec:decompress_exp_rows_at",
    "torch_pagecomp.kernels.launch:_arg_class",
    "torch_pagecomp.kernels.launch:_hooks_set",
    "triton.backends.nvidia.driver:CudaLauncher.__call__",
    "torch_pagecomp.offload._entry:_is_param_like",
    "torch_pagecomp.offload._paged:PagedStored.ready",
    "torch_pagecomp.offload._paged:PagedStore.free",
    "torch_pagecomp.offload._paged:PagedStore._count_failures",
    "torch_pagecomp.offload._stores:ClassPolicy.poll",
    "torch_pagecomp.offload._streams:current_stream",
    "torch_pagecomp.offload._hooks:ActivationOffloader.next_group",
    "torch_pagecomp.offload._hooks:ActivationOffloader.__enter__",
    "torch_pagecomp.offload._hooks:ActivationOffloader.__exit__",
    "torch_pagecomp.offload._batch:Batcher.flush",
    "torch_pagecomp.offload._batch:Batcher.add",
    "torch_pagecomp.offload._batch:joined",
    "torch_pagecomp.offload._backward:Backward._end_backward",
    "torch_pagecomp.offload._backward:Backward._prefetch_from",
    # the copy engine's store (session 61): the plan, the host's sends
    "torch_pagecomp.kernels.host_pack:place_slice_at",
    "torch_pagecomp.offload._paged:PagedStore._place",
    "torch_pagecomp.offload._paged:PagedStore._slot",
    "torch_pagecomp.offload._paged:PagedStore._payload",
    "torch_pagecomp.offload._paged:PagedStore.refusal",
    "torch_pagecomp.offload._paged:PagedStore.send_now",
    "torch_pagecomp.offload._decode:ramps",
    "torch_pagecomp.offload._arena:VirtualArena._send",
    "torch_pagecomp.offload._arena:VirtualArena._publish",
    "torch_pagecomp.offload._arena:VirtualArena._placed",
    "torch_pagecomp.offload._arena:VirtualArena.room_now",
    "torch_pagecomp.offload._copies:copy_to_host",
    "torch_pagecomp.offload._batch:gpu_memory",
    "torch_pagecomp.offload._batch:Batcher.store_due",
)

# ``--fine``: the steps of one compressed offload (``PagedStore.offload`` / ``_store_slice``
# and the hook around them), to see what a saved tensor's ~300 us of host time is made of
FINE_TARGETS = (
    "torch_pagecomp._events:handoff",
    "torch_pagecomp._events:mark",
    "torch_pagecomp.offload._streams:on_stream.__enter__",
    "torch_pagecomp.offload._streams:on_stream.__exit__",
    "torch_pagecomp.offload._arena:_meta_views",
    "torch_pagecomp.offload._arena:VirtualArena.host_desc",
    "torch_pagecomp.offload._arena:VirtualArena.add",
    "torch_pagecomp.offload._arena:VirtualArena._unbacked",
    "torch_pagecomp.offload._arena:VirtualArena._fold",
    "torch_pagecomp.offload._arena:VirtualArena.release",
    "torch_pagecomp.offload._arena:_Slice.__init__",
    "torch_pagecomp.offload._paged:_compress",
    "torch_pagecomp.offload._paged:PagedStore._compress_slice",
    "torch_pagecomp.offload._paged:PagedStore._scratch",
    "torch_pagecomp.offload._paged:PagedStored.__init__",
    "torch_pagecomp.offload._entry:_Entry.__init__",
    "torch_pagecomp.offload._stores:ClassPolicy.choose",
    "torch_pagecomp.offload._stores:ClassPolicy.sample",
    "torch_pagecomp.offload._hooks:ActivationOffloader._paged_store",
    "torch_pagecomp.offload._hooks:ActivationOffloader._stash_victim",
    "torch_pagecomp.offload._ledger:HostLedger.remove",
    "torch_pagecomp.kernels.launch:launch",
)


def timer_stats() -> collections.defaultdict:
    """What :func:`instrument` fills: each timed function's name -> every call's ns, in order
    (calls, total, longest and median all come from it: a mean hides a few long waits)."""
    return collections.defaultdict(list)


def _wrap(stats, name, fn):
    @functools.wraps(fn)
    def timed(*args, **kwargs):
        t0 = time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            stats[name].append(time.perf_counter_ns() - t0)
    return timed


def instrument(stats, targets=TARGETS) -> list:
    """Wrap every target (module attribute or class attribute), timed into ``stats``
    (:func:`timer_stats`); return the undo list. A function imported by name into another
    module before this runs keeps its unwrapped binding there: such bindings in the
    package's modules are wrapped too."""
    undo = []
    for target in targets:
        mod_name, qual = target.split(":")
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            continue
        owner, attr = mod, qual
        if "." in qual:
            cls, attr = qual.split(".")
            owner = getattr(mod, cls)
        fn = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr, None)
        if fn is None:
            continue
        timed = _wrap(stats, qual, fn)
        setattr(owner, attr, timed)
        undo.append((owner, attr, fn))
        if owner is mod:  # the modules of the package that imported it by name
            undo += rebind_imported(attr, fn, timed, skip=mod)
    return undo


def rebind_imported(attr: str, fn, new, skip=None) -> list:
    """Set ``attr`` to ``new`` in every module of the package whose ``attr`` is ``fn`` (a
    function imported there by name; ``skip``: a module left as it is); the undo list of
    ``(module, attr, fn)``."""
    undo = []
    for name, mod in list(sys.modules.items()):
        if (mod is not skip and name.startswith("torch_pagecomp")
                and getattr(mod, attr, None) is fn):
            setattr(mod, attr, new)
            undo.append((mod, attr, fn))
    return undo


class _GcPauses:
    """Collections of Python's cyclic GC while timing, and their pauses (``gc.callbacks``):
    a variant whose host time rises in every function alike may be paying for the collector."""

    def __init__(self):
        self.runs = collections.Counter()
        self.ns = 0
        self.longest = (0, None)  # (ns, generation): a lone long pause lands in whichever
        self._t0 = 0  # timed function allocated when the collector ran
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter_ns()
        else:
            ns = time.perf_counter_ns() - self._t0
            self.runs[info["generation"]] += 1
            self.ns += ns
            self.longest = max(self.longest, (ns, info["generation"]), key=lambda x: x[0])

    def stop(self, steps: int) -> str:
        gc.callbacks.remove(self._callback)
        runs = ", ".join(f"gen{g} {n / steps:.1f}" for g, n in sorted(self.runs.items()))
        ns, gen = self.longest
        longest = f", longest {ns / 1e6:.2f} ms (gen{gen})" if gen is not None else ""
        return f"{runs or 'none'}, {self.ns / steps / 1e6:.2f} ms{longest}"


def training_step(name: str, variant: str, fsdp: bool = False):
    """``(step, offloader)``: one SGD step of stock model ``name`` on the GPU under
    ``variant``'s hooks (``none``: no hooks, offloader None); ``fsdp``: the model under FSDP2
    over the process group of this process (``bench.stock_models.shard``)."""
    import torch

    from bench.stock_models import CopyOnlyTuner, build, shard
    from torch_pagecomp import offload_module

    gc.collect()  # the previous variant's model and offloader go before this one starts
    torch.cuda.empty_cache()
    model, x, blocks = build(name, "cuda")
    if fsdp:
        shard(model, blocks, "cuda")
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    kw = {"none": None, "uncompressed": dict(mode="uncompressed"),
          "memory": dict(prefer="memory"), "memory_lz4": dict(prefer="memory", codec="lz4"),
          "speed": dict(prefer="speed"), "speed_copy_only": dict(prefer="speed",
                                                                 tuner=CopyOnlyTuner())}[variant]
    off = offload_module(model, blocks=blocks, **kw) if kw is not None else None

    def step():
        opt.zero_grad(set_to_none=True)
        model(x).float().square().mean().backward()
        opt.step()

    return step, off


def issue_ms(step, n: int) -> float:
    """The median host ms of ``n`` calls of ``step``, each from an idle GPU."""
    import torch

    out = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        out.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(out)


def measure(name: str, variant: str, steps: int, warmup: int, targets=TARGETS,
            fsdp: bool = False) -> str:
    step, off = training_step(name, variant, fsdp=fsdp)
    for _ in range(warmup):
        step()
    for _ in range(20):  # prefer="speed": timed once its tuner has chosen (as the stock bench)
        if off.tuner is None or off.tuner.choice is not None:
            break
        step()
    before = dict(off.counters)
    pauses = _GcPauses()
    plain = issue_ms(step, steps)
    gc_note = f"gc per step: {pauses.stop(steps)}; tracked objects {len(gc.get_objects())}"
    per_step = {k: round((v - before.get(k, 0)) / steps, 1) for k, v in off.counters.items()
                if k in ("offloaded_raw", "offloaded_compressed", "served_from_stash",
                         "restored_prefetch", "in_flight_waits")}
    stats = timer_stats()
    undo = instrument(stats, targets)
    waited = _host_wait_us(off)
    pauses = _GcPauses()  # the timed steps' too: is a function's longest call a collection?
    try:
        timed = issue_ms(step, steps)
    finally:
        for owner, attr, fn in undo:
            setattr(owner, attr, fn)
        gc_note += f"; gc per timed step: {pauses.stop(steps)}"
    waited = (_host_wait_us(off) - waited) / steps / 1e3
    off.remove()
    lines = [f"## {name} {variant}: host issue {plain:.1f} ms per step "
             f"({timed:.1f} ms with timers); per step {per_step}"
             + (f"; tuner chose {off.tuner.choice}" if off.tuner is not None else "")
             + f"; {gc_note}; host waits for packs {waited:.2f} ms per step (timed steps)",
             "| function | calls / step | ms / step | us / call | median us / call | "
             "longest call us |",
             "|---|---|---|---|---|---|"]
    for fn_name, each in sorted(stats.items(), key=lambda kv: -sum(kv[1])):
        ns = sum(each)
        lines.append(f"| {fn_name} | {len(each) / steps:.0f} | {ns / steps / 1e6:.2f} | "
                     f"{ns / len(each) / 1e3:.1f} | {statistics.median(each) / 1e3:.1f} | "
                     f"{max(each) / 1e3:.0f} |")
    return "\n".join(lines)


def _host_wait_us(off) -> float:
    """Microseconds the offloader's compressed stores have waited for packs so far
    (``VirtualArena.wait_s``: ``back`` and ``host_desc`` waiting before they pin or reuse)."""
    return sum(st.arena.wait_s for st in getattr(off, "_paged", {}).values()) * 1e6


def stock_parser(variants: str) -> argparse.ArgumentParser:
    """The options of the probes that time stock models' steps (this one and
    ``dev_step_profile``): ``--models``, ``--variants`` (default ``variants``), ``--steps``,
    ``--warmup``."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="encoder-1024,resnet-64")
    ap.add_argument("--variants", default=variants)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=4)
    return ap


def main() -> None:
    ap = stock_parser("uncompressed,memory")
    ap.add_argument("--fine", action="store_true",
                    help="also time the steps of one compressed offload (FINE_TARGETS)")
    ap.add_argument("--fsdp", action="store_true",
                    help="the model under FSDP2 over torchrun's ranks (torchrun "
                         "--nproc_per_node 2 -m bench.dev_hook_timing --fsdp); each rank's "
                         "table, printed by rank 0 (not with speed: its ranks may choose apart)")
    a = ap.parse_args()
    targets = TARGETS + FINE_TARGETS if a.fine else TARGETS
    rank = 0
    if a.fsdp:
        import torch.distributed as dist

        from bench.dev_ab_steps import _process_group, every_rank

        rank = _process_group("cuda")
    for name in a.models.split(","):
        for variant in a.variants.split(","):
            text = measure(name, variant, a.steps, a.warmup, targets, a.fsdp)
            if a.fsdp:  # every rank's table (a collective: all ranks call it), printed by rank 0
                every = every_rank(f"(FSDP2, rank {rank}) {text}")
                text = "\n".join(every) if rank == 0 else ""
            if text:
                print(text, flush=True)
    if a.fsdp:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
