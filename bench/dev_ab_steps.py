"""Dev probe: offload variants compared step by step inside one process (#21).

``python3 -m bench.dev_ab_steps --models bert-1024 --arms uncompressed,memory,memory_group``
(GPU): one model, one offloader per arm, the arms' steps interleaved (a round is one step of
each arm, the order rotating), so every arm sees the same host. Lent hosts differ by up to 1.9x
in Python speed from one core to the next, and which cores are slow changes within seconds
(``bench/results/h200_eb9f4b0_session35``): separate processes, as ``gpu_suite.sh ab`` runs,
compare host-bound rows only as far as their cores happened to match. Prints per arm the median
step (CUDA events) and host issue time, their spread over the rounds, and the step as a
multiple of the first arm's. ``--block N``: each arm runs N steps in a row per round, the first
of each block reported apart (the steps after a switch of arms pay for the other arm's use of
the host's caches and the allocator; a process that runs one variant never does).
``--reset-peak block`` (with ``--block`` > 1): the allocator's peak is reset at each block's
start only, not at each step's, so the block's later steps run as a loop that never resets it
(the hooks' hold rule reads the peak since the last reset, ``_batch.Batcher._over_peak``); a
step's peak is then the block's so far.

``--gc manual`` (the default since session 73): Python's automatic cyclic collection off in
the measured steps, a generation-1 collection after each step outside its time, as torchtitan's
loop runs it; ``--gc auto``: as Python runs it (a full collection of T5's ~400k tracked
objects, 175-215 ms, then lands in whichever arm's step is running, every few steps). Each
arm's collector ms a step is reported either way. ``--settle N``: each offloading arm's own
steps before timing, until a block of them pins nothing (at most N).

``--fsdp``: the model under FSDP2, over ``torchrun``'s ranks (``torchrun --nproc_per_node 2
-m bench.dev_ab_steps --fsdp ...``) or, run alone, a process group of one rank. ``--out
FILE``: the arms ``none`` / ``uncompressed`` / ``memory`` / ``speed`` also as JSON rows of
``bench.stock_models``' schema (``method``: interleaved), each arm's first gradients set
against a step without offload (every rank's shard).

Arms: ``none``, ``uncompressed``, ``memory`` (as ``bench.stock_models``), ``memory_group``:
``memory`` with the hooks' batched restores through ``restore_group`` instead of
``restore_placed`` (the path before 2026-11-29); ``memory_single``: ``memory`` with every
saved storage stored alone (``_batch.BATCH_BYTES = 0``: the path before batches);
``memory_restore256``, ``memory_batch128``, ``memory_placed1``: ``memory`` with one constant
changed (:data:`PATCHES`: the restores' batch bytes, the offloads' batch bytes, a tensor
restored alone through the batched path); ``memory_shrink1``: the arena's shrink as before
session 49 (the last step's busiest moment kept, the rest unpinned at once);
``memory_alloc``: each slice's payload from the caching allocator, as before session 49
(``memory_same``, ``memory``'s code without the gradient check that then ran on the timed
offloaders, was the probes' baseline until d3ab56d moved that check to offloaders of its
own: removed);
``memory_both``: the first two together (session 48: none reliably faster than ``memory``,
``bench/results/h200x2_96f5538_session48``);
``uncompressed_nohold``, ``memory_nohold``: with nothing held for the backward (every saved
storage stored once its batch closes, as before the hooks held the last groups);
``memory_whole``: a batch of several storages restored into one buffer (living until its
last member is used), not member by member (as before 0df64c3);
``memory_views``: a single restore decodes through views of each slice (as before 8023323),
not by address;
``memory_wait``: a due compressed store waits for the link (``_batch.Batcher._starts_now``
always true, as before session 44) instead of staying held; ``memory_lazy``: the other way, a
due compressed store stays held whether the link keeps up or not, until the in-flight bound
stores the oldest (one H200: faster than the package on encoder-1024 and BERT-large in two
runs, on ResNet-50 in one of two, slower on GPT-2 and ViT-B/16 in one, and BERT's GPU peak
0.07 GiB higher, where a plain copy keeps up and frees what this holds;
``bench/results/h200_0a6fe49_session50``). ``uncompressed_eager``, ``memory_eager``: a due
store starts as soon as the link has room, even where the GPU's allocation is below the peak
it has reached (``_batch.Batcher._over_peak`` never holds: before session 53).
``memory_slice32``, ``memory_slice16``: the compressed store's slices of 32 / 16 MiB, not 64
(a smaller fixed-stride payload on the GPU, more launches a tensor); ``memory_slots2``: two
slices' payloads, the compress a slice ahead of the pack, as before session 55 (one H200:
no faster than one payload on four models, ResNet-50's GPU peak 0.04 GiB higher,
``bench/results/h200x2_824437a_session55``). (``memory_holdstatus``, the statuses held
until the backward's end, went with session 56's ring of statuses, ``offload._statuses``;
``memory_hostmeta``, placed slices' metadata in page-locked buffers of their own, went once
it lay in the arena behind their pages.) ``memory_no_wait``: where the payload the store
picks holds a slice whose placement the host would wait for, another payload whose pages
have left is taken instead, made if need be, whatever the last step's peak (under FSDP2 the
host waited up to 34 ms a step for placements, ``bench/results/h200x2_session70``).
``memory_join``: a batch joined by one
``torch.cat`` before its compress, as before session 57 (now the compress reads the
members where they lie, ``PagedStore.takes_parts``).
``memory_second_per_slice``: the second payload made for each of its slices and let go with
it, not kept between them (session 82: a lower peak, a slower step; not adopted);
``memory_payload_grow``: a payload buffer made again only where a slice needs more than it
holds (not also where it needs less than half of it);
``memory_small_near_peak``: slices of 16 MiB, not 64, where two full payloads would not fit
under the last step's GPU peak (written in session 82 for the ResNets' peak, not yet run);
``memory_slots1``: one payload (``_paged.SCRATCH_SLICES``), as before session 61;
``memory_in_turn``: both payloads held and taken in turn, not the second only while the link
is behind (``PagedStore._slot``); ``memory_in_turn32``: that, with slices of 32 MiB (the two
hold what one of 64 MiB held). Session 61, one H200 (``bench/results/h200_session61``):
in turn, Llama-style 0.83x a plain copy against 0.96x with one payload, ResNet-50 1.02x
against 1.05x, but ResNet-50's GPU peak 1.350 against a plain copy's 1.315 GiB; 32 MiB
slices in turn 0.86x and 1.20x. ``memory_nobacklog``: due batches stored whatever the
link's backlog (``_paged.BACKLOG_BYTES``); ``memory_keep_deferred``: a batch deferred once
in a pass stays held for the backward (with the pack kernel the link stayed behind to the
forward's end, so deferred batches were read in place: session 61's counters; session 62,
one H200: 1.12x / 1.13x a plain copy on encoder-1024 / ViT-B/16 against ``memory``'s 1.17x /
1.20x, 1.22x / 1.20x on BERT-large / ResNet-50 against 1.18x / 1.18x, with GPU peaks above
a plain copy's on those two, ``bench/results/h200_session62``).
``memory_tail15``, ``memory_tail30``: no due store once a pass has saved 85 / 70% of the
last pass's bytes (:func:`_tail_swaps`). Session 87, one H200, one process: encoder-1024 1.10x
/ 1.04x a plain copy's step against ``memory``'s 1.12x, BERT-large 1.08x / 1.05x against
1.27x, but ResNet-50 1.21x / 1.16x against 1.06x, and at 30% BERT-large's GPU peak above a
plain copy's (1.614 against 1.553 GiB); a tail following the stores the last backward met
late (35ff166, reverted) gained nothing beyond the probe's noise
(``bench/results/h200_session87``).
``memory_lastpeak``: a due batch is held while the GPU's allocation, with room for two more
groups, is below the last step's peak too (``PagedStore.step_peak``), not only below the peak
since the caller last reset it (``Batcher._over_peak``): a loop that resets the peak at each
step's start (this probe, the stock bench) held nothing in its forward by that rule, one that
never resets it holds what fits under the highest step so far (session 62, one H200: BERT-large
1.02x and ResNet-50 1.20x a plain copy against ``memory``'s 1.08x and 1.24x, encoder-1024
1.32x and ViT-B/16 1.09x against 1.26x and 1.01x, ``bench/results/h200_session62``).
``memory_late``: a compressed source leaves the stash in a forward once its pages are in
host memory (packed), as before session 60, not once they are compressed
(``_entry._Entry.source_read``).
``memory_nowait``: the host
arena pins another chunk where the slices in flight could need it, instead of waiting for
the oldest to be placed (``VirtualArena._room``): under FSDP2 the host bounds the step, and
that wait is host time. ``speed``: ``prefer="speed"``,
its tuner's trials and check run first in consecutive steps of its own (a pass's period is
from its start to the next one's: interleaved, it would hold the other arms' steps), so it is
measured at the choice it settled on, beside the other arms on the same host; its decisions
are printed. ``speed_warm2``: ``speed`` with its tuner's first trials after 2 compressed
passes, as before session 64, not 8 (its trials and check run in steps of its own too,
after ``speed``'s; session 64 ran it as ``speed_warm8`` beside the default of then, 2).
``speed_copy_only``: ``speed``'s code path copying from its first pass
(``bench.stock_models.CopyOnlyTuner``). Arms measured and removed:
``memory_hold1``, only the current group held (no faster than two groups on four models, a
higher GPU peak on encoder-1024, ``bench/results/h200_7683f39_session44``); the arena's spare
chunks kept (8 at least, not 2) or pinned without waiting for slices in flight (16): no step
time gained (``bench/results/h200_0991b9a_session42``); ``memory_netpeak``, the second
payload (``PagedStore._slot``) taken under the last step's peak less the most bytes the
payloads beyond the first held in that step: no lower peak on the ResNets (1.246 / 1.344 GiB
against ``memory``'s 1.238 / 1.344 and a plain copy's 1.218 / 1.314,
``bench/results/h200_session68``); ``uncompressed_sizepool``, the plain copies in
exact-size pinned buffers (``pools.PinnedBufferPool``, the hooks' pool before session 78)
instead of chunks (``offload._copy_arena``): at one length the chunks' step 125.9 against
128.3 ms on GPT-2, 50.2 against 51.9 on encoder-1024 (one run, ranges overlapping), holding
4.19 against 3.61 GiB on GPT-2 (``bench/results/h200_session78``, call 5); the pool's
shrink went with it (``uncompressed_shrink1`` and ``uncompressed_lastsizes``, its rules
before sessions 59 and 74, had gone before). Each
arm's peak GPU memory over its steps, and its page-locked host memory held at the end, are
printed too. (A ``memory_tight`` arm, the arena keeping the step's peak of placed bytes
instead of backed ones, held the same page-locked memory at the same step time on
hf-llama-2048, encoder-2048 and ViT-B/16, ``bench/results/h200_967571b_session41``: removed.)
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import statistics
import sys
import time

ARMS = ("none", "save_on_cpu", "uncompressed", "memory", "memory_group", "memory_single",
        "memory_restore256", "memory_batch128", "memory_both", "memory_placed1", "memory_shrink1",
        "memory_alloc", "memory_whole", "memory_views",
        "uncompressed_nohold", "memory_nohold", "memory_wait", "memory_lazy", "memory_nowait",
        "uncompressed_eager", "memory_eager", "memory_slice32", "memory_slice16", "memory_slots2",
        "memory_join", "memory_late", "memory_slots1",
        "memory_in_turn", "memory_in_turn32", "memory_nobacklog", "memory_keep_deferred",
        "memory_lastpeak", "memory_no_wait", "memory_second_per_slice", "memory_payload_grow",
        "memory_small_near_peak", "memory_tail15", "memory_tail30", "speed", "speed_copy_only",
        "speed_warm2")


# arms that set package constants while their steps run: ((module, name, value), ...)
_RESTORE256 = ("torch_pagecomp.offload._backward", "RESTORE_BATCH_BYTES", 256 << 20)
_BATCH128 = ("torch_pagecomp.offload._batch", "BATCH_BYTES", 128 << 20)
PATCHES = {
    "memory_single": (("torch_pagecomp.offload._batch", "BATCH_BYTES", 0),),
    "memory_restore256": (_RESTORE256,),
    "memory_batch128": (_BATCH128,),
    "memory_both": (_RESTORE256, _BATCH128),
    "memory_placed1": (("torch_pagecomp.offload._backward", "BATCH_MIN_ENTRIES", 1),),
    # the arena's shrink as before session 49: the last step's busiest moment kept, the rest
    # of its chunks unpinned at once
    "memory_shrink1": (("torch_pagecomp.offload._arena", "SHRINK_STEPS", 1),),
    # the compressed store's GPU payloads: slices of 32 or 16 MiB (not 64), or two slices'
    # payloads, the compress running a slice ahead of the pack (before session 55)
    "memory_slice32": (("torch_pagecomp.offload._paged", "SLICE_BYTES", 32 << 20),),
    "memory_slice16": (("torch_pagecomp.offload._paged", "SLICE_BYTES", 16 << 20),),
    "memory_slots2": (("torch_pagecomp.offload._paged", "SCRATCH_SLICES", 2),),
    # one payload (as before session 61), and two of 32 MiB slices taken in turn
    "memory_slots1": (("torch_pagecomp.offload._paged", "SCRATCH_SLICES", 1),),
    "memory_in_turn32": (("torch_pagecomp.offload._paged", "SLICE_BYTES", 32 << 20),),
    # due batches stored whatever the link's backlog (session 61's first way)
    "memory_nobacklog": (("torch_pagecomp.offload._paged", "BACKLOG_BYTES", 1 << 62),),
}


def _swaps(arm: str) -> list[tuple[object, str, object]]:
    """``(owner, attribute, value)`` of each thing ``arm`` changes in the package while its
    steps run (none for a variant's own arm)."""
    import importlib

    from torch_pagecomp.offload import _backward
    from torch_pagecomp.offload._arena import VirtualArena
    from torch_pagecomp.offload._batch import Batcher
    from torch_pagecomp.offload._paged import PagedStore

    if arm.startswith("memory_in_turn"):  # both payloads held, taken in turn (session 61's
        # first way), not the second only while the link is behind
        return [(PagedStore, "_slot", _in_turn)] + [
            (importlib.import_module(m), name, v) for m, name, v in PATCHES.get(arm, ())]
    if arm in PATCHES:
        return [(importlib.import_module(m), name, v) for m, name, v in PATCHES[arm]]
    if arm.endswith("_nohold"):  # nothing held: every storage stored once its batch closes,
        # as before the window
        return [(Batcher, "window", property(lambda self: 0))]
    if arm == "memory_nowait":  # the arena pins a chunk rather than wait for a pack
        return [(VirtualArena, "_room", VirtualArena._unbacked)]
    if arm.endswith("_eager"):  # a due store starts once the link has room, whatever the
        # GPU's allocation (as before the peak rule, ``Batcher._over_peak``)
        return [(Batcher, "_over_peak", lambda self, dev: None)]
    if arm == "memory_keep_deferred":  # a batch deferred once in a pass (the link behind)
        # stays held for the backward, as the pack kernel's slow placement kept it (session 61)
        starts = Batcher._starts_now
        return [(Batcher, "_starts_now",
                 lambda self, batch: not batch.deferred and starts(self, batch))]
    if arm in ("memory_tail15", "memory_tail30"):  # no due store in the forward's last 15 /
        # 30% of the bytes the previous pass saved (:func:`_tail_swaps`)
        return _tail_swaps(int(arm[len("memory_tail"):]) / 100)
    if arm == "memory_lastpeak":  # a due batch held below the last step's GPU peak too,
        # not only below the peak since the caller last reset it (a loop that resets it each
        # step, as this probe and the stock bench do, held nothing in its forward)
        return [(Batcher, "_over_peak", _over_last_peak)]
    if arm == "memory_no_wait":  # the other payload, whatever the peak, where the one
        # picked holds a slice whose placement the host would wait for (session 70's lead)
        pick = PagedStore._pick
        return [(PagedStore, "_pick", lambda self, nbytes: _pick_no_wait(self, nbytes, pick))]
    if arm == "memory_wait":  # a due store waits for the link instead of staying held
        return [(Batcher, "_starts_now", lambda self, batch: True)]
    if arm == "memory_lazy":  # a due compressed store stays held (as if the link were always
        # behind) until the in-flight bound stores the oldest
        return [(PagedStore, "refusal", lambda self, nbytes: "backlog")]
    if arm in ("memory_second_per_slice", "memory_payload_grow"):  # the package's payload,
        # let go after its slice where not the first's, or kept where it holds more than the
        # slice needs (:func:`_payload_second_per_slice`, :func:`_payload_grow`)
        real = PagedStore._payload
        rule = _payload_second_per_slice if arm == "memory_second_per_slice" else _payload_grow
        return [(PagedStore, "_payload",
                 lambda self, slot, n, device: rule(self, slot, n, device, real))]
    if arm == "memory_small_near_peak":  # smaller slices where the GPU is near its peak
        return [(PagedStore, "_slices", _slices_near_peak)]
    if arm == "memory_alloc":  # a payload of the caching allocator per slice (before 49)
        return [(PagedStore, "_payload", _fresh_payload)]
    if arm == "memory_whole":  # a batch restored into one buffer, as before 0df64c3
        from torch_pagecomp.offload._entry import _Entry

        return [(_Entry, "split_members", lambda self: None)]
    if arm == "memory_views":  # a single restore decodes through the slices' views (its
        # pages, statuses and metadata parts), as before 8023323
        from torch_pagecomp.offload import _paged

        return [(_paged, "_by_address", lambda out: False)]
    if arm == "memory_join":  # a batch joined by one torch.cat before its compress, as before
        # session 57 (now the compress reads the members where they lie)
        return [(PagedStore, "takes_parts", property(lambda self: False))]
    if arm == "memory_late":  # a compressed source kept until packed (before session 60)
        from torch_pagecomp.offload._entry import _Entry

        return [(_Entry, "source_read", _Entry.ready)]
    if arm == "memory_group":  # batched restores through restore_group
        return [(_backward, "restore_placed", lambda store, storeds, outs: False)]
    return []


def _tail_swaps(frac: float) -> list[tuple[object, str, object]]:
    """The ``memory_tail*`` arms: once a pass has saved ``1 - frac`` of the bytes the pass
    before it saved, ``Batcher.store_due`` stores nothing more (the in-flight bound still
    stores the oldest past ``max_in_flight_bytes``), so the forward's last ``frac`` stays on
    the GPU and the backward reads it in place, whatever the host's speed. The hypothesis:
    the fast of encoder-1024's two steady modes (session 86: 0.81-0.98x a plain copy, against
    1.11-1.26x) is the package holding such a tail because the link was behind when the host
    came back to it; a tail held by rule should land every process there, with a GPU peak
    still at or below a plain copy's (which holds what its link has not moved)."""
    import weakref

    from torch_pagecomp.offload._batch import Batcher

    add, store_due = Batcher.add, Batcher.store_due

    def counting_add(batcher, src, esize, ff, alone=None):
        ps = batcher._owner()._pass
        tail = getattr(batcher, "_tail", None)  # [this pass (weakly), its bytes, the last's]
        if tail is None or tail[0]() is not ps:
            tail = batcher._tail = [weakref.ref(ps), 0, tail[1] if tail is not None else 0]
        tail[1] += src.numel()
        return add(batcher, src, esize, ff, alone)

    def tail_store_due(batcher):
        tail = getattr(batcher, "_tail", None)
        if tail is not None and tail[2] and tail[1] >= (1 - frac) * tail[2]:
            batcher.behind = False  # (nothing to try again at the next saved storage)
            return
        store_due(batcher)

    return [(Batcher, "add", counting_add), (Batcher, "store_due", tail_store_due)]


def _over_last_peak(batcher, dev):
    """``Batcher._over_peak`` against the higher of the peak since the last reset and the
    last step's (``PagedStore.step_peak``, noted at each backward's end): the
    ``memory_lastpeak`` arm."""
    from torch_pagecomp.offload._batch import gpu_memory

    counts = gpu_memory(dev)
    if counts is None:
        return None
    allocated, peak = counts
    store = batcher._owner()._paged.get(dev.index)
    last = store.step_peak if store is not None and store.step_peak is not None else 0
    return allocated + 2 * batcher.last_group_bytes - max(peak, last)


def _waits_by(arenas, was) -> str:
    """The timed rounds' host waits for placements by why the host waited (the compressed
    stores' ``host_wait_us_by`` now, less ``was``, before the rounds), in seconds, as
    `` (payload 0.120, room 0.030)``; empty where it did not wait."""
    by: collections.Counter = collections.Counter()
    for sign, stats in ((1, arenas), (-1, was)):
        for c in stats:
            for why, us in c.get("host_wait_us_by", {}).items():
                by[why] += sign * us
    parts = [f"{why} {us / 1e6:.3f}" for why, us in sorted(by.items()) if us > 0]
    return f" ({', '.join(parts)})" if parts else ""


def _pick_no_wait(store, nbytes: int, pick):
    """``pick`` (``PagedStore._pick``), except that where the payload it picks holds a slice whose
    placement the GPU has not published (its copies not queued: ``_store_slice`` would have
    the host wait for it), a payload whose last slice is done is taken instead, made if need
    be, whatever the last step's peak (the ``memory_no_wait`` arm)."""
    slot = pick(store, nbytes)
    last = slot.last
    if last is not None and last.send is not None and not last.known():
        for other in store._slots:
            if other is not slot and (other.last is None or other.last.done()):
                return other
    return slot


def _in_turn(store, nbytes: int):
    """``PagedStore._slot`` taking the payloads in turn, each kept once made (the
    ``memory_in_turn`` arms)."""
    slot = min(store._slots, key=lambda s: s.used)
    store._uses += 1
    slot.used = store._uses
    return slot


def _fresh_payload(store, slot, n: int, device):
    """``PagedStore._payload`` as it was before session 49: the caching allocator's, per
    slice (``slot``'s buffer unused), read on the pack stream (the ``memory_alloc`` arm)."""
    import torch

    buf = torch.empty((n, store.page_size), dtype=torch.uint8, device=device)
    if store.pack_stream is not None:
        buf.record_stream(store.pack_stream)
    return buf


NEAR_PEAK_SLICE_BYTES = 16 << 20  # (memory_small_near_peak) a slice's bytes near the peak


def _slices_near_peak(store, pages: int):
    """``PagedStore._slices``, except that where two full slices' payloads would not fit under
    the last step's GPU peak (``_below_peak``: the allocation is near it, as at a ResNet's
    forward peak, where two 64 MiB payloads of slices in flight held its peak above a plain
    copy's, ``bench/results/h200_session82``), slices of ``NEAR_PEAK_SLICE_BYTES`` (the
    ``memory_small_near_peak`` arm: smaller payloads there, more launches; the
    payloads follow the slice's size, ``_payload``). Untried on a GPU when written."""
    most = store.slice_pages
    if not store._below_peak(2 * most * store.page_size):
        most = max(1, min(most, NEAR_PEAK_SLICE_BYTES // store.page_size))
    return ((first, min(most, pages - first)) for first in range(0, pages, most))


def _payload_grow(store, slot, n: int, device, real):
    """``PagedStore._payload`` (``real``), except that a slot's buffer is made again only
    where a slice needs more than it holds, not also where it needs less than half of it
    (the ``memory_payload_grow`` arm: session 82's host samples put 1.4-1.7 ms a step on
    encoder-1024 and ConvNeXt-T in ``_payload``'s allocation; released as before at each
    backward's start). Session 82 (``bench/results/h200_session82``): no step faster across
    four models, ConvNeXt-T's peak 0.27 GiB higher: not adopted."""
    if slot.buf is not None and slot.end is not None and slot.buf.numel() >= n * store.page_size:
        return slot.buf
    return real(store, slot, n, device)  # (too small, or none: made at the slice's size)


def _payload_second_per_slice(store, slot, n: int, device, real):
    """``PagedStore._payload`` (``real``), except that a slot other than the first keeps no
    buffer: each of its slices gets one of its own, freed once its pages have left it (the
    ``memory_second_per_slice`` arm; ``_pick`` then takes the second only under the last
    step's peak at every slice). One H200, session 82 (``bench/results/h200_session82``): the
    ResNet-style model's GPU peak 1.215 against 1.229 GiB, but ``memory``'s step 2-7% slower
    on it, ResNet-50 and the Llama-style model (the host waited for placements 2-6 times as
    long): not adopted."""
    buf = real(store, slot, n, device)  # (made afresh where the slot holds none)
    if slot is not store._slots[0]:
        slot.buf = None  # the slice holds it (its copies' streams recorded on it)
    return buf


@contextlib.contextmanager
def _arm_patch(arm: str):
    """What an arm changes in the package (:func:`_swaps`), set while its steps run and put
    back after, also when a step raises."""
    undo = []
    try:
        for owner, name, value in _swaps(arm):
            undo.append((owner, name, getattr(owner, name)))
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, real in reversed(undo):
            setattr(owner, name, real)


@contextlib.contextmanager
def _hooked(model, blocks: list, off):
    """``off``'s hooks on ``model``'s blocks while the body runs (nothing for None)."""
    from torch_pagecomp import offload_module

    if off is not None:
        offload_module(model, blocks=blocks, offloader=off)
    try:
        yield
    finally:
        if off is not None:
            off.remove()


SETTLE_STEPS = 12  # the most settling steps an arm takes (see :func:`measure`)


class _Collector:
    """Python's cyclic collector in :func:`measure`'s steps (its ``gc_mode``), one step at a
    time (:meth:`begin` before the step's timing, :meth:`end` after it, also when it raised),
    so it is left as it was between steps and after a failure: ``"manual"`` turns automatic
    collection off for the step, and :meth:`end` collects generation 1 outside its time;
    ``"auto"`` records the pauses of automatic collections inside the step
    (``bench.dev_hook_timing._GcPauses``). Seconds by arm, counted from the last
    :meth:`reset`."""

    def __init__(self, mode: str):
        if mode not in ("manual", "auto"):
            raise ValueError(f"gc_mode must be 'manual' or 'auto', got {mode!r}")
        self.mode = mode
        self.seconds: collections.Counter = collections.Counter()
        self.full: collections.Counter = collections.Counter()  # automatic full collections
        self._steps = 1  # the timed steps an arm (:meth:`close`)
        self._arm = self._pauses = None
        self._was_enabled = False

    def begin(self, arm: str) -> None:
        self._arm = arm
        if self.mode == "manual":
            self._was_enabled = gc.isenabled()
            gc.disable()
        else:
            from bench.dev_hook_timing import _GcPauses

            self._pauses = _GcPauses()

    def end(self) -> None:
        if self.mode == "manual":  # the step's young objects, outside its time
            t0 = time.perf_counter()
            gc.collect(1)
            self.seconds[self._arm] += time.perf_counter() - t0
            if self._was_enabled:
                gc.enable()
        else:
            pauses, self._pauses = self._pauses, None
            pauses.stop(1)
            self.seconds[self._arm] += pauses.ns / 1e9
            self.full[self._arm] += pauses.runs[2]

    def reset(self) -> None:
        self.seconds.clear()
        self.full.clear()

    def per_step(self, arm: str) -> float:
        """The arm's collector ms a step over the steps :meth:`close` was given."""
        return round(self.seconds[arm] * 1e3 / self._steps, 3)

    def close(self, steps: int) -> str:
        """The table's line of each arm's collector time a step over ``steps`` timed steps an
        arm."""
        self._steps = max(steps, 1)
        if self.mode == "manual":
            how = ("manual: automatic collection off in the measured steps, a generation-1 "
                   "collection after each step, outside its time; its ms a step")
        else:
            how = "auto: the collector's pauses inside each arm's timed steps, ms a step"
        arms = ", ".join(f"{a} {self.seconds[a] * 1e3 / self._steps:.2f}"
                         + (f" ({self.full[a]} full)" if self.full[a] else "")
                         for a in self.seconds)
        return f"gc {how}: {arms or 'none'}"


def measure(name: str, arms: list[str], rounds: int, warmup: int, block: int = 1,
            device: str | None = None, fsdp: bool = False,
            rows: list[dict] | None = None, stall_s: float | None = None,
            sample_ms: float | None = None, reset_peak: str = "step",
            trace: bool = False, settle: int = SETTLE_STEPS,
            gc_mode: str = "manual") -> list[str]:
    """The table of ``arms`` on model ``name`` (``device``: CUDA where there is one, else the
    CPU, a smoke test on the tiny models); with ``fsdp``, the model under FSDP2
    (``fully_shard`` per block, then the whole) over the process group of this process.

    ``rows``: also append a row per arm of :data:`VARIANTS` in ``bench.stock_models``' JSON
    schema (``model``, ``gpus``, ``variant``, ``step_ms``, ``peak_gpu_gib``, ``host_gib``,
    ``ratio``, ``link_bound``, ``grads_identical``), measured interleaved. For the gradients,
    before any optimizer step each arm takes one step under deterministic settings from the
    same parameters, on an offloader of its own (:func:`_first_grads`), and its gradient
    hashes (every rank's shard) are set against ``none``'s (taken twice: a model that is not
    deterministic there gets ``None``).

    ``stall_s``: a step whose host part runs past this prints the Python stacks then, with its
    arm, step and rank (``bench.dev_step_modes.StallWatch``): under FSDP2 a few of
    ``memory``'s steps ran 3-4x the median (``bench/results/h200x2_96f5538_session48``).
    ``sample_ms``: sample the host's Python frames every that many ms in the timed rounds
    (``bench.dev_step_modes.HostSampler``) and print, per arm, where its host time went.

    ``settle``: after the warm-up rounds, each offloading arm takes steps of its own until
    ``block`` of them in a row pin no page-locked buffer (its plain copies' pool and its
    arena have grown to what the steps need), at most ``settle`` steps an arm. A warm-up round
    is one step an arm, and a plain copy's pool grows with how far the link lags over steps
    in a row: on one H200 the plain copy pinned 25 buffers in ConvNeXt-T's 12 timed steps
    (each pin costs the host milliseconds) while ``speed``, copying the same way after its
    own trial steps, pinned none and ran 0.90x its step (``bench/results/h200_session73``):
    the baseline was timed while still growing.

    ``gc_mode``: ``"manual"`` turns Python's automatic cyclic collection off for the
    measured steps and runs a generation-1 collection after each step, outside its time (as
    torchtitan's training loop runs its own collections); ``"auto"`` leaves the collector as
    it is. With ``"auto"`` a full collection (~400k tracked objects on T5: 175-215 ms) lands
    every few steps in whichever arm's step allocated at that moment: one such pause in a
    timed step of 3 is ~70 ms a step in one arm's median, whatever it offloads
    (``bench/results/h200_session73``). Either way the table reports each arm's collector
    time a step (manual: its generation-1 collections; auto: the pauses in its timed
    steps): the hooks' Python objects are part of what the collector walks."""
    import torch

    from bench.dev_step_modes import HostSampler, StallWatch
    from bench.stock_models import build, per_step, shard, variant_settings
    from bench.training_bench import CountingSaveOnCpu
    from torch_pagecomp import ActivationOffloader

    cuda = torch.cuda.is_available() if device is None else device == "cuda"
    where = "cuda" if cuda else "cpu"
    # what an earlier model of this process left allocated would sit under every arm's peak
    # (each arm's offloaders are closed at the end of :func:`measure`, the rest collected)
    gc.collect()
    left = torch.cuda.memory_allocated() / 2**30 if cuda else 0.0
    model, x, blocks = build(name, where)
    if fsdp:
        shard(model, blocks, where)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def settings(arm: str) -> dict:  # a probe arm is its variant's offloader (_arm_patch)
        if arm == "speed_warm2":  # the tuner's first trials after 2 compressed passes (the
            from torch_pagecomp import StepTuner  # default before session 64), not 8

            return dict(variant_settings("speed", where), tuner=StepTuner(warmup=2))
        variant = ("memory" if arm.startswith("memory_")
                   else "uncompressed" if arm.startswith("uncompressed_") else arm)
        return variant_settings(variant, where)

    def make(arm: str) -> ActivationOffloader:
        return ActivationOffloader(**settings(arm))

    offs = {a: make(a) for a in arms if a not in ("none", "save_on_cpu")}
    # torch's own pinned offload, its bytes counted (the stock bench's save_on_cpu row)
    saver = CountingSaveOnCpu() if "save_on_cpu" in arms else None

    def forward(arm: str):
        if arm != "save_on_cpu":
            return model(x)
        with saver:
            return model(x)

    steps_taken = [0]
    rank = f", rank {torch.distributed.get_rank()}" if fsdp else ""
    # each step's loss, kept on the device (no sync): a model whose training diverged (inf,
    # NaN) or whose activations collapsed stores pages no real run makes, and its rows
    # would compare codecs on them (see :func:`_health`)
    losses: dict[str, list] = collections.defaultdict(list)

    sampler = None
    collector = _Collector(gc_mode)

    def step(arm: str, reset: bool = True) -> tuple[float, float, float]:
        steps_taken[0] += 1
        label = f"{name} {arm} step {steps_taken[0]}{rank}"
        if trace:  # which arm a step that fails asynchronously ran (a CUDA error names none)
            print(f"[ab] {label}", file=sys.stderr, flush=True)
        watch = StallWatch(stall_s, label) if stall_s else None
        collector.begin(arm)
        try:
            with _hooked(model, blocks, offs.get(arm)), _arm_patch(arm):
                if cuda:
                    if reset:
                        torch.cuda.reset_peak_memory_stats()
                    e0 = torch.cuda.Event(enable_timing=True)
                    e1 = torch.cuda.Event(enable_timing=True)
                    e0.record()
                if sampler is not None:
                    sampler.label = arm
                t0 = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                loss = forward(arm).float().square().mean()
                loss.backward()
                opt.step()
                issue = (time.perf_counter() - t0) * 1e3
                losses[arm].append(loss.detach())
                if sampler is not None:
                    sampler.label = None
                if cuda:
                    e1.record()
                    e1.synchronize()
        finally:
            if watch is not None:
                watch.cancel()
            collector.end()
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
        return (e0.elapsed_time(e1) if cuda else issue), issue, peak

    grads = _first_grads(model, forward, blocks, arms, fsdp, make) if rows is not None else {}
    tuned, own = {}, {}  # speed arm -> its own steps, each (arm, ms, host buffers made)
    for sa in [a for a in ("speed", "speed_warm2") if a in offs]:  # their trials and check
        sp, tuned[sa], own[sa] = offs[sa], 0, []  # in steps of their own (see the docstring)
        while _any_rank(tuned[sa] < 34 and (sp.tuner.choice is None or sp.tuner.checking),
                        fsdp):
            ms = step(sa)[0]
            own[sa].append((sp.tuner.arm, ms, sp.host_buffers_made()))
            tuned[sa] += 1
    for _ in range(warmup):
        for arm in arms:
            step(arm)
    settled = {}  # arm -> steps it took until ``block`` in a row pinned nothing
    for arm in offs:
        quiet = taken = 0
        while _any_rank(quiet < max(block, 1) and taken < settle, fsdp):
            had = _chunks(offs[arm])[0]
            step(arm)
            taken += 1
            quiet = quiet + 1 if _chunks(offs[arm])[0] == had else 0
        settled[arm] = (taken, quiet >= max(block, 1))
    # host peaks from the timed rounds only (not the warm-up's, nor speed's trials)
    for off in offs.values():
        off.reset_peak_stats()
    collector.reset()
    before = {a: off.stats() for a, off in offs.items()}
    chunks0 = {a: _chunks(off) for a, off in offs.items()}
    res = {a: ([], [], [], []) for a in arms}  # steps ms, host issue ms, first steps of
    # blocks, peak GPU GiB
    if sample_ms:
        sampler = HostSampler(sample_ms / 1e3)
    pinned = collections.defaultdict(list)  # arm -> "round.step in block: buffers" it pinned
    pins_timed = collections.Counter()  # arm -> page-locked buffers pinned in its timed steps
    for r in range(rounds):
        k = r % len(arms)
        for arm in arms[k:] + arms[:k]:
            for i in range(block):
                had = _chunks(offs[arm])[0] if arm in offs else 0
                ms, issue, peak = step(arm, reset=reset_peak == "step" or i == 0)
                if (made := (_chunks(offs[arm])[0] if arm in offs else 0) - had) > 0:
                    pinned[arm].append(f"{r}.{i}: {made}")
                    pins_timed[arm] += made
                res[arm][3].append(peak)
                if i == 0 and block > 1:  # the step after a switch of arms: kept apart
                    res[arm][2].append(ms)
                    continue
                res[arm][0].append(ms)
                res[arm][1].append(issue)
    if sampler is not None:
        sampler.close()
    gc_line = collector.close(rounds * block)
    base = statistics.median(res[arms[0]][0])
    how = (f"blocks of {block} steps per arm (the first of each block apart)" if block > 1
           else "interleaved steps")
    lines = [f"## {name}{' (FSDP2)' if fsdp else ''}: {rounds} rounds of {how}, after {warmup} "
             f"warm-up rounds (GPU memory allocated before the model: {left:.2f} GiB)",
             "settling steps (an arm's own, until a block of them pinned nothing; at most "
             f"{settle}): " + (", ".join(f"{a} {n}{'' if ok else ' (still pinning)'}"
                                         for a, (n, ok) in settled.items()) or "none"),
             "| arm | step ms (median) | step ms min-max | host issue ms (median) | "
             f"vs {arms[0]} | first step of a block ms (median) | peak GPU GiB (max) | "
             f"vs {arms[0]} round by round: median (quartiles) |",
             "|---|---|---|---|---|---|---|---|"]
    for arm in arms:
        t, h, first, peaks = res[arm]
        med = statistics.median(t)
        lines.append(f"| {arm} | {med:.1f} | {min(t):.1f}-{max(t):.1f} | "
                     f"{statistics.median(h):.1f} | {med / base:.2f}x | "
                     f"{statistics.median(first) if first else float('nan'):.1f} | "
                     f"{max(peaks):.3f} | {paired(t, res[arms[0]][0])} |")
    drift = rounds_line({a: res[a][0] for a in arms}, rounds)
    if drift:
        lines.append(drift)
    if pinned:  # a pin costs the host ~37 ms a 64 MiB chunk: which timed steps paid it
        lines.append("page-locked buffers pinned in timed steps (round.step of its block: "
                     "buffers): "
                     + "; ".join(f"{a} {', '.join(v)}" for a, v in pinned.items()))
    lines.append(gc_line)
    for off in offs.values():
        off.synchronize()
    health = _health(model, losses)
    lines.append(health["line"])
    by_rank = {}  # speed arm -> each rank's (choice, own steps' arms, arm in the timed steps)
    for sa in tuned:
        t = offs[sa].tuner.summary()
        lines.append(f"{sa}: {tuned[sa]} steps of its own first; choice {t['choice']} "
                     f"(checking: {offs[sa].tuner.checking}); trial ms "
                     f"{t['trial_ms']}; decisions {t['decisions']}")
        lines.append(f"{sa}'s own steps: arm, ms (host buffers and chunks made so far): "
                     + ", ".join(f"{arm[:4]} {ms:.1f} ({made})" for arm, ms, made in own[sa]))
        if fsdp:  # each rank's tuner decides on its own passes' times (none is shared)
            by_rank[sa] = every_rank((t["choice"], [arm for arm, _, _ in own[sa]],
                                      offs[sa].tuner.arm))
            lines.append(_ranks_line(sa, by_rank[sa]))
    # per timed step, the hooks' own host ms (pack / unpack) and what they did (pack calls,
    # restores, stores...): the first over the second gives the cost of one
    done = {a: per_step(before[a], off.stats(), rounds * block, off.counters)
            for a, off in offs.items()}
    if rows is not None:
        mine = _stock_rows(name, arms, res, offs, grads, rounds, fsdp,
                           saver.bytes / 2**30 if saver is not None else None)
        for row in mine:
            row["reset_peak"] = reset_peak
            if row["variant"] in by_rank:
                row["tuner_choice_by_rank"] = [r[0] for r in by_rank[row["variant"]]]
            row["loss_finite"] = health["loss_finite"].get(row["variant"])
            row["params_finite"] = health["params_finite"]
            if row["variant"] in done:
                row["hook_host_ms"], row["counters_per_step"] = done[row["variant"]]
            if row["variant"] in settled:  # its settling steps, and whether they settled it
                row["settling_steps"], row["settled"] = settled[row["variant"]]
                # each pin costs the host milliseconds inside a timed step
                row["pinned_in_timed_steps"] = pins_timed[row["variant"]]
            row["gc"], row["gc_ms_per_step"] = gc_mode, collector.per_step(row["variant"])
            if row["variant"] in res:  # the host's share of the step (slack_line)
                row["host_issue_ms"] = round(statistics.median(res[row["variant"]][1]), 2)
        rows += mine
    lines += ["| arm | page-locked host GiB held | of which arena (its peak) | host waits for "
              "packs s (timed rounds) | hooks' host ms a step (pack / unpack) | "
              "pack calls / restores a step | "
              "page-locked buffers pinned / unpinned in the timed rounds (arena chunks and "
              "plain copies' chunks) |",
              "|---|---|---|---|---|---|---|"]
    for arm, off in offs.items():
        st = off.stats()
        hm, n = done[arm]
        arenas = list(st.get("compressor", {}).values())
        held = st.get("pinned_held_bytes", 0) + sum(c["host_held_bytes"] for c in arenas)
        peak = sum(c["host_peak_held_bytes"] for c in arenas)
        was = before[arm].get("compressor", {}).values()  # the timed rounds' waits only
        wait = (sum(c.get("host_wait_us", 0) for c in arenas)
                - sum(c.get("host_wait_us", 0) for c in was)) / 1e6
        lines.append(f"| {arm} | {held / 2**30:.2f} | "
                     f"{sum(c['host_held_bytes'] for c in arenas) / 2**30:.2f} "
                     f"({peak / 2**30:.2f}) | {wait:.3f}{_waits_by(arenas, was)} | "
                     f"{hm.get('pack', 0.0):.1f} / {hm.get('unpack', 0.0):.1f} | "
                     f"{n.get('packed', 0):.0f} / "
                     f"{n.get('restored_prefetch', 0) + n.get('restored_on_demand', 0):.0f} | "
                     + " / ".join(str(b - a) for a, b in zip(chunks0[arm], _chunks(off)))
                     + " |")
    slack = slack_line(res, done)
    if slack:
        lines.append(slack)
    refused = refused_line(done)
    if refused:
        lines.append(refused)
    if sampler is not None:
        lines.append(f"### Where the host's timed steps went (a sample every {sample_ms} ms)")
        for arm in arms:
            lines += sampler.table(arm, rounds * block)
    # their GPU scratch and page-locked memory, not the next model's; the collection first: a
    # stall dump's frames can keep the last step's graph (and its saved tensors) alive
    gc.collect()
    for arm, off in offs.items():
        try:
            off.close()
        except RuntimeError as exc:  # its memory goes when it is collected instead
            lines.append(f"({arm}'s offloader not closed: {exc})")
    return lines


VARIANTS = ("none", "save_on_cpu", "uncompressed", "memory", "speed")  # arms with a JSON row


def rounds_line(steps: dict, rounds: int) -> str | None:
    """Each arm's median step ms round by round (``steps``: arm -> its timed steps' ms in
    order, the same number each round), and how far apart its rounds are (the slowest
    round's median over the fastest's): where one arm's own rounds differ by as much as two
    arms do, medians of arms run apart compare the host's drift, not the arms (session 82:
    BERT-large's plain copy 150 and 178 ms in its two rounds). None for one round."""
    if rounds < 2:
        return None
    parts = []
    for arm, t in steps.items():
        per = len(t) // rounds
        if per == 0:
            return None
        meds = [statistics.median(t[r * per:(r + 1) * per]) for r in range(rounds)]
        parts.append(f"{arm} {' / '.join(f'{m:.1f}' for m in meds)} "
                     f"({max(meds) / min(meds):.2f}x)")
    return "each arm's median step ms by round (slowest round over fastest): " + "; ".join(parts)


def slack_line(res: dict, done: dict) -> str | None:
    """The line that hints whether compressing can pay on this step (session 74, twelve models:
    where the plain copy's host slack was 1.5 times an arm's extra host time in the hooks or
    more, it beat the plain copy; 1.1 times or less, it lost. A rule of thumb only: in session
    77 ViT-B/16 at 1.5 times ran 1.08x, ``bench/results/h200_session77``): the plain copy's
    step less its host issue time (medians), and each other offloading arm's hooks' host ms a
    step over the plain copy's. None without an ``uncompressed`` arm. ``res``: arm -> (steps
    ms, host issue ms, ...); ``done``: arm -> (hooks' host ms a step by hook, counters)."""
    if "uncompressed" not in res or "uncompressed" not in done:
        return None
    steps, issue = res["uncompressed"][0], res["uncompressed"][1]
    slack = statistics.median(steps) - statistics.median(issue)
    base = sum(done["uncompressed"][0].values())
    extra = ", ".join(f"{arm} {sum(hm.values()) - base:.1f}" for arm, (hm, _) in done.items()
                      if arm != "uncompressed")
    return (f"host slack: the plain copy's step less its host issue time {slack:.1f} ms; "
            f"the hooks' host ms a step over the plain copy's: {extra or 'no other arm'}")


def refused_line(done: dict) -> str | None:
    """Each compressing arm's due stores put off a step, by the reason
    (``PagedStore.refusal``: the link's backlog, the GPU behind with the next payload, the
    arena's room) beside the members put off at least once (``deferred``): what held its
    batches on the GPU. None where no arm put a store off. ``done``: arm -> (hooks' host ms
    a step by hook, counters a step)."""
    parts = []
    for arm, (_, n) in done.items():
        why = {r: n.get(f"refused_{r}", 0) for r in ("backlog", "payload", "room")}
        if any(why.values()) or n.get("deferred", 0):
            parts.append(f"{arm} " + " / ".join(f"{v:.1f}" for v in why.values())
                         + f" (members put off {n.get('deferred', 0):.1f})")
    if not parts:
        return None
    return "stores put off a step, backlog / payload / room: " + "; ".join(parts)


def paired(steps: list[float], base: list[float]) -> str:
    """The step of each round as a multiple of the base arm's in the same round: median and
    quartiles. A round's two steps share the host's speed of the moment, so their ratio's
    spread shows what a difference of medians can resolve (one H200: on BERT-large two arms
    storing the same way had medians 11% apart, ``bench/results/h200_0a6fe49_session50``)."""
    r = [a / b for a, b in zip(steps, base)]
    if len(r) < 4:
        return f"{statistics.median(r):.2f}x"
    q = statistics.quantiles(r, n=4)
    return f"{statistics.median(r):.2f}x ({q[0]:.2f}-{q[2]:.2f})"


def _chunks(off) -> tuple[int, int]:
    """The page-locked buffers ``off`` pinned and unpinned so far: its compressed stores'
    arena chunks and its plain copies' chunks (``offload._copy_arena``)."""
    arenas = [st.arena for st in off._paged.values()]
    return (sum(a.pins for a in arenas) + off.pool.misses,
            sum(a.unpins for a in arenas) + off.pool.drops)


def _first_grads(model, forward, blocks, arms: list[str], fsdp: bool, make) -> dict:
    """Per arm, the gradient hashes of one step from the current parameters under
    deterministic settings (every rank's shard, as ``bench.stock_models`` hashes them), no
    optimizer step; ``"reference"``: those of two steps without offload (``None`` where they
    differ: the model is not deterministic here). Each offloading arm's step runs on an
    offloader of its settings made for it (``make(arm)``) and closed after: the timed
    offloaders never see this step, whose SDPA math kernel saves the attention matrix too.
    Run on the timed ones, it left ``memory`` up to 2.4 GiB more page-locked memory for
    several steps and, on encoder-2048 under FSDP2, a GPU peak of 2.68-2.71 against 2.17 GiB
    and steps 5-9% slower than probe arms of the same code that skipped it
    (``bench/results/h200x2_91fcaaa_session49``)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from bench.stock_models import _grad_hash

    def grads_of(arm: str) -> list:
        off = make(arm) if arm not in ("none", "save_on_cpu") else None
        with _hooked(model, blocks, off):
            model.zero_grad(set_to_none=True)
            forward(arm).float().square().mean().backward()
        if off is not None:
            off.close()
        mine = _grad_hash(model)
        return every_rank(mine) if fsdp else mine

    out = {}
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with sdpa_kernel(SDPBackend.MATH):
            ref = grads_of("none")
            out["reference"] = ref if grads_of("none") == ref else None
            for arm in arms:
                if arm in VARIANTS and arm != "none":
                    out[arm] = grads_of(arm)
    finally:
        torch.use_deterministic_algorithms(False)
    model.zero_grad(set_to_none=True)
    return out


def _health(model, losses: dict) -> dict:
    """Whether the run measured a model that still trains: every arm's losses finite (and
    their first and last), every parameter finite. ``{"line", "loss_finite": {arm: bool},
    "params_finite": bool}``; the line says DIVERGED where either is not."""
    import torch

    from bench.stock_models import local_part

    finite, spans = {}, []
    for arm, got in losses.items():
        v = torch.stack(got).float().cpu()
        finite[arm] = bool(torch.isfinite(v).all())
        spans.append(f"{arm} {v[0].item():.4g} -> {v[-1].item():.4g}")
    params = all(bool(torch.isfinite(local_part(p.detach()).float()).all())
                 for p in model.parameters())
    ok = params and all(finite.values())
    line = (f"model health: {'ok' if ok else 'DIVERGED'}; parameters finite: {params}; "
            f"losses (first -> last step): {'; '.join(spans)}")
    return {"line": line, "loss_finite": finite, "params_finite": params}


def _stock_rows(name: str, arms: list[str], res: dict, offs: dict, grads: dict, rounds: int,
                fsdp: bool, saved_gib: float | None = None) -> list[dict]:
    """The arms of :data:`VARIANTS` as rows of ``bench.stock_models``' JSON (medians of the
    interleaved steps), with its rules: link-bound where a plain copy's step is at least 1.5x
    the step without offload, the ratio as a plain copy's host bytes over the arm's.
    ``saved_gib``: the bytes ``save_on_cpu`` moved in its last step (its host memory)."""
    import torch.distributed as dist

    from bench.stock_models import LINK_BOUND_X

    gpus = dist.get_world_size() if fsdp else 1
    med = {a: statistics.median(res[a][0]) for a in arms if a in VARIANTS}
    host = {}
    for arm in med:
        off = offs.get(arm)
        host[arm] = (off.stats()["peak_host_bytes"] / 2**30 if off is not None
                     else saved_gib if arm == "save_on_cpu" else None)
    bound = (med["uncompressed"] >= LINK_BOUND_X * med["none"]
             if "none" in med and "uncompressed" in med else None)
    ref = grads.get("reference")
    flat = [h for r in ref for h in r] if fsdp and ref else ref
    # all-zero gradients would hide any restore's bytes: the check could not fail
    checkable = bool(flat) and any(flat)
    rows = []
    for arm in med:
        unc, mine = host.get("uncompressed"), host[arm]
        rows.append({
            "model": name, "gpus": gpus, "variant": arm, "method": "interleaved",
            "rounds": rounds, "step_ms": med[arm], "step_ms_all": res[arm][0],
            "peak_gpu_gib": max(res[arm][3]), "peak_gpu_gib_all": res[arm][3],
            "host_gib": mine,
            "ratio": unc / mine if unc and mine else None, "link_bound": bound,
            "grads_identical": (grads.get(arm) == ref if checkable and arm != "none"
                                else None)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="bert-1024,tv-resnet50")
    ap.add_argument("--arms", default="uncompressed,memory,memory_group")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--gc", default="manual", choices=["manual", "auto"],
                    help="Python's cyclic collector in the measured steps: off, with a "
                         "generation-1 collection after each step outside its time (manual, as "
                         "torchtitan runs it), or as Python runs it (auto)")
    ap.add_argument("--settle", type=int, default=SETTLE_STEPS,
                    help="after the warm-up rounds, at most this many steps of each "
                         "offloading arm alone until a block of them pins nothing (0: none)")
    ap.add_argument("--block", type=int, default=1,
                    help="steps of an arm in a row per round (>1: the first of each apart, so "
                         "the others compare as one process per arm would, on one host)")
    ap.add_argument("--reset-peak", choices=("step", "block"), default="step",
                    help="when the allocator's peak is reset in the timed rounds: at each "
                         "step's start (as the stock bench), or at each block's only (as a loop "
                         "that never resets it, after the block's first step)")
    ap.add_argument("--fsdp", action="store_true",
                    help="the model under FSDP2: over torchrun's ranks (torchrun "
                         "--nproc_per_node 2 -m bench.dev_ab_steps --fsdp ...; rank 0 prints), "
                         "or run alone, a process group of this one process (NCCL on a GPU, "
                         "gloo on the CPU): FSDP2's all-gathers, reshards and hooks with the "
                         "arms interleaved")
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None,
                    help="where the model runs (default: CUDA where there is one)")
    ap.add_argument("--out", default=None,
                    help="also write the arms none / uncompressed / memory / speed as JSON in "
                         "bench.stock_models' schema (each row's method: interleaved), with "
                         "their gradients set against no offload")
    ap.add_argument("--trace", action="store_true",
                    help="print each step's model, arm and number to stderr before it runs")
    ap.add_argument("--stall-dump", type=float, default=None,
                    help="seconds: a step's host part running longer prints its Python stacks "
                         "(with its arm, step and rank) to stderr")
    ap.add_argument("--sample-host", type=float, default=None,
                    help="ms: sample the host's Python frames this often in the timed rounds "
                         "and print where each arm's host time went")
    a = ap.parse_args()
    arms = a.arms.split(",")
    bad = [x for x in arms if x not in ARMS]
    if bad:
        ap.error(f"--arms: unknown {bad}; choose from {', '.join(ARMS)}")
    rank = _process_group(a.device) if a.fsdp else 0
    rows = [] if a.out else None
    # no try/finally: a rank that fails must not wait at a barrier while the others are in
    # another collective (that hangs); torchrun stops them instead (as bench.stock_models)
    for name in a.models.split(","):
        lines = measure(name, arms, a.rounds, a.warmup, a.block, device=a.device,
                        fsdp=a.fsdp, rows=rows, stall_s=a.stall_dump, trace=a.trace,
                        sample_ms=a.sample_host, reset_peak=a.reset_peak, settle=a.settle,
                        gc_mode=a.gc)
        if rank == 0:
            print("\n".join(lines), flush=True)
            if a.out:  # after each model: a later model's crash keeps the earlier rows
                _write(a.out, rows, a.device)
    if a.fsdp:  # ended as bench.stock_models ends its process group, for a clean exit
        import torch.distributed as dist

        from bench.stock_models import end_process_group

        end_process_group(dist.get_backend() == "nccl")


def _write(path: str, rows: list[dict], device: str | None) -> None:
    """``rows`` as ``bench.stock_models`` writes its JSON (``stock_models.run_meta``, then
    ``rows``), with ``method``: interleaved."""
    import json

    import torch

    from bench.stock_models import run_meta

    cuda = torch.cuda.is_available() if device is None else device == "cuda"
    doc = {**run_meta(cuda), "method": "interleaved", "gpus": rows[0]["gpus"] if rows else 1,
           "rows": rows}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)


def _any_rank(flag: bool, fsdp: bool) -> bool:
    """``flag`` on any rank (``stock_models.any_rank``) under ``--fsdp``, else ``flag``."""
    if not fsdp:
        return flag
    import torch.distributed as dist

    from bench.stock_models import any_rank

    return any_rank(flag, "cuda" if dist.get_backend() == "nccl" else "cpu")


def _ranks_line(arm: str, ranks: list) -> str:
    """Whether every rank's tuner of ``arm`` chose alike: ``ranks`` holds each rank's
    ``(choice, its own steps' arms, its arm after the timed rounds)``. Under FSDP2 a step
    waits for the slowest rank, so ranks that chose apart run the slower way's steps."""
    own = [r[1] for r in ranks]
    differ = sum(len(set(col)) > 1 for col in zip(*own)) if own and own[0] else 0
    return (f"{arm} on each rank: choices {[r[0] for r in ranks]}, arms after the timed "
            f"rounds {[r[2] for r in ranks]}; its own steps' arms differed between ranks in "
            f"{differ} of {min(len(o) for o in own) if own else 0}")


def every_rank(obj) -> list:
    """``obj`` as each rank of the process group gave it, in rank order
    (``all_gather_object``)."""
    import torch.distributed as dist

    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, obj)
    return every


def _process_group(device: str | None) -> int:
    """The process group FSDP2 runs over: torchrun's (``WORLD_SIZE`` set; this rank's GPU is
    ``LOCAL_RANK``), else one of this process alone. NCCL on a GPU, gloo on the CPU
    (``device``: as for :func:`measure`). Returns this process's rank."""
    import os

    import torch
    import torch.distributed as dist
    import torch.distributed.fsdp  # noqa: F401  (before the group: see stock_models._fsdp_rows)

    cuda = torch.cuda.is_available() if device is None else device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    backend = "nccl" if cuda else "gloo"
    if "WORLD_SIZE" in os.environ:  # torchrun
        dist.init_process_group(backend)
    else:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group(backend, rank=0, world_size=1)
    return dist.get_rank()


if __name__ == "__main__":
    main()
