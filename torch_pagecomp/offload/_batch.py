"""Saved storages held until their group leaves the backward's first reach, and small ones
stored together: the offloader's storages between the pack hook and their store.

**Held for the backward.** The first unpack of a backward restores the last ``prefetch + 1``
groups of the forward at once (``_backward``), so the GPU holds those groups' bytes when the
backward starts whether they went over the link or not. Their storages therefore stay where
they are (:attr:`Batcher.window` groups: the current group and the ``prefetch`` before it);
a group is stored when it falls out of that window (:meth:`Batcher.end_group`). The backward
then reads the last groups in place: their bytes cross the link neither way, and their
compress, pack, restore and decode are not run. Before this, every saved storage was stored at
once and only the latest group's were kept in place: the same GPU memory when the backward
starts, with a round trip for the group before it and a store for both. Held storages count
against ``max_in_flight_bytes`` and ``max_in_flight_tensors`` as unfinished offloads do: past
either the oldest are stored. A held storage whose saved tensors autograd frees (an
intermediate of the forward, a graph dropped without a backward) is never stored, and a batch
whose members are all freed stops counting against the bounds (:meth:`Batcher.prune`). Held ones
are stored when a new pass starts, at :meth:`~._hooks.ActivationOffloader.synchronize`, and at
the end of a backward that left them alive (a retained graph). With ``prefetch=0`` nothing is
held: each group is stored at its end.

**Stored as fast as the link goes, not faster.** A compressed store plans its slices in the
host arena at their worst case (``_arena.VirtualArena.back``); once the chunks held are spoken
for by slices not yet packed, the next store would make the host wait for the link. It does
not: a batch due for a store whose store would wait stays held, with the batches after it,
and is tried again at the next saved storage and group end (:meth:`Batcher.store_due`). So
the forward never waits for the link (its compute goes on), and what the link has not moved
when the backward starts is read there in place: no compress, pack, restore or decode for it,
and no bytes over the link either way. A plain copy behaves so by itself (its copies queue
behind the link and the stash keeps their sources); before this, a compressed store made the
host wait instead, so the GPU was emptier when the backward began, and the backward brought
back over the link bytes a plain copy read in place (encoder-1024 on an H200: 1.06 GiB of
compressed bytes up against 1.00 GiB of plain ones, ``bench/results/h200_7683f39_session44``).
The GPU bytes held stay bounded by ``max_in_flight_bytes``: past it the oldest batch is
stored, waiting if need be.

**Stored only to stay under the peak.** A due batch is also held while the GPU's allocation,
with room for two more groups like the last, is below the most the caching allocator has
allocated since its peak was last reset (:meth:`Batcher._over_peak`); past that line the oldest
due batches whose bytes cover the excess are stored. Memory below the peak is reserved by the
process and used again each step: storing there lowers no peak, and costs a store, a restore
and the bytes over the link both ways. A network whose activations shrink over its forward (a
ResNet's later stages) then holds its later groups; one whose allocation only grows (a
transformer's blocks) stores as before. Without this rule whether those groups were stored
followed the host's speed: a host slower than the link stored everything, and the compressed
step was host-bound (ResNet-50 on one H200, one process each: 1.28x a plain copy's step in
one, 0.92x in another of the same code). Interleaved against the old way on ResNet-50, in
four runs on one GPU and under FSDP2, ``memory``'s step was 2-11% shorter and its host
memory 1.38 against 1.81-1.88 GiB; on one GPU a plain copy's GPU peak was 1.34-1.35 against
1.72-2.19 GiB (``bench/results/h200x2_de2195a_session53``). Holding more on every model
instead (the probe ``memory_lazy``, session 50) raised BERT-large's GPU peak; there this rule
holds nothing (the allocation is at its peak at every group's end).

**Stored together.** A compressed offload costs the host about the same whatever its size:
the store's two launches and events each way, its allocations, and the hooks' book-keeping of
an entry (stash, ledger, group, restore). One by one, that was 110-180 us a tensor of 1-16 MiB
on an H200 host; four tensors stored as one took 47-56 us a tensor, sixteen 14-38 us
(``bench/results/h200_0991b9a_session42/batch_offload_0991b9a.txt``). So storages of one
codec, element size and compute stream, each whole pages and at most half of
:data:`BATCH_BYTES`, of a class the ratio policy has decided, join one batch of up to
:data:`BATCH_BYTES`, stored as one entry (interleaved steps, against each storage stored
alone: ResNet-50 1.24x -> 1.10x a plain copy's step, BERT-large 1.37x -> 1.09x; same
directory). Batches of 128 MiB (storages up to 64 MiB) halve the entries again on GPT-2,
ResNet-50 and encoder-1024, but did not make a step reliably faster: against 64 MiB,
interleaved in one process, 1.025x a plain copy's step against 1.049x over 16 model rows (one
H200 and FSDP2 on two), the difference under twice its standard error, and the last of four
runs went the other way (``bench/results/h200x2_96f5538_session48``). Other storages (a sample
of an undecided class, a partial last page, a large one, a plain copy) are a batch of one.

* each member starts at a page-aligned byte offset of its batch; its saved tensor is a view of
  the batch's bytes there (``_Packed``'s offset). Until the batch is stored, the members stay
  in ``entry.parts`` (``(byte offset, storage)`` each), and an unpack reads its member there;
* a batch is closed when full or when its group ends, and stored when its group leaves the
  window (not while a CUDA graph is captured). On a GPU its compress reads the members where
  they lie, by a table of page addresses (``PagedStore.offload``'s parts), and the stash
  keeps them until it has read them, as it keeps a single storage. Joining them first (one
  ``torch.cat``, still the way on the CPU and with checksums) held a batch's bytes twice while
  the copy was made, and that moment was the forward's GPU peak on BERT-large and
  encoder-1024 (``bench/results/h200x2_a242d2b_session56``, ``dev_peak_owners``); read in
  place, BERT-large's peak on one H200 moved to the backward, level with a plain copy's (1.554
  against 1.553 GiB), steps level with the join within their spread
  (``bench/results/h200x2_fd0815b_session57``). The join also cost the compute stream a read
  and a write of every byte stored;
* the batch's restore decodes each member whose saved tensors are alive into a buffer of its
  own (``_entry._Member``, held by those saved tensors' handles alone), which goes back to the
  allocator as autograd releases them: one buffer for the batch lived until its last member
  was used, above a plain copy's restores at BERT-large's backward peak;
* a batch that cannot be stored (its ``cat`` out of GPU memory, its store failing, a plain
  copy with the pinned pool full) keeps its members where they are: each saved tensor is served
  from its own storage, as a single offload that fails is.
"""

from __future__ import annotations

import collections
import weakref

import torch

from ._entry import _capturing, _Entry, _in_backward
from ._streams import current_stream, on_stream

BATCH_BYTES = 64 << 20  # the store's slice (``_paged.SLICE_BYTES``): one compress launch


class Batch:
    """Storages (``uint8 [n_i]``) waiting to be stored as one entry (the ``_Entry`` every
    member's saved tensor holds, reached through a weak reference: a batch whose saved tensors
    are all freed is not stored). ``key``: ``(device, compute stream, float format, element
    size)``, what the members share. ``alone``: ``(codec, class)`` of a storage stored alone
    (``codec`` None: a plain copy), else None. ``freed``: called with the weak reference when
    the entry is freed (any thread, any moment)."""

    __slots__ = ("key", "ref", "nbytes", "members", "alone", "group", "deferred",
                 "held_below_peak")

    def __init__(self, key: tuple, entry: _Entry, alone: tuple | None = None, freed=None):
        self.key, self.ref, self.alone = key, weakref.ref(entry, freed), alone
        self.group = (weakref.ref(entry.pass_), entry.group)
        self.nbytes = self.members = 0
        # flags named as the offloader's counters of the members they mark (each counted once)
        self.deferred = False  # its store waited for the link at least once
        self.held_below_peak = False  # held at least once because the GPU was below its peak

    def add(self, entry: _Entry, src: torch.Tensor) -> int:
        """Append ``src`` to ``entry``'s parts; returns its byte offset in the batch."""
        base = self.nbytes
        entry.parts.append((base, src))
        self.nbytes += src.numel()
        self.members += 1
        return base

    def before(self, ps, group: int) -> bool:
        """Whether the batch is of an older pass than ``ps``, or of a group before ``group``."""
        mine, k = self.group
        return mine() is not ps or k < group


def gpu_memory(dev: torch.device) -> tuple[int, int] | None:
    """``(bytes allocated now, the most allocated since the peak was last reset)`` by the
    caching allocator on CUDA device ``dev`` (None for another device): one call for the
    nested counters (``torch.cuda.memory_allocated`` builds a flat copy of every counter,
    and would twice for both)."""
    if dev.type != "cuda":
        return None
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    counts = torch._C._cuda_memoryStats(index)["allocated_bytes"]["all"]
    return counts["current"], counts["peak"]


def joined(entry: _Entry) -> torch.Tensor:
    """The members' bytes back to back, queued on the compute stream they were saved on (the
    one member itself, else one ``torch.cat``). The members stay in ``entry.parts`` (a failed
    ``cat``, out of GPU memory, leaves them where they are)."""
    if len(entry.parts) == 1:
        return entry.parts[0][1]
    with on_stream(entry.stream):
        return torch.cat([p for _, p in entry.parts])


class Batcher:
    """The held storages and batches of one :class:`~._hooks.ActivationOffloader`
    (``offloader._batcher``): a part it owns, reaching its state (pass, stores, stash,
    counters) through a weak reference, as ``_backward.Backward`` does. Called under the
    offloader's lock."""

    def __init__(self, offloader):
        self._owner = weakref.ref(offloader)
        self.open: dict[tuple, Batch] = {}  # batches of the current group taking members
        self.held: collections.deque[Batch] = collections.deque()  # closed, oldest first
        self.members = 0  # saved storages in batches not stored (held where they are)
        self.nbytes = 0  # their bytes on a GPU
        self.due: tuple | None = None  # (pass, group): batches before it are due a store
        self.behind = False  # a due batch waits for the link (tried again at the next add)
        self.last_group_bytes = 0  # the saved bytes of the group that ended last
        # weak references to the entries of batches not stored that were freed since the last
        # :meth:`prune` (their callback appends: a bound ``list.append`` keeps no cycle through
        # the batcher, and is safe on whatever thread autograd frees them)
        self._freed: list[weakref.ref] = []

    @property
    def window(self) -> int:
        """Groups whose storages are held: the current one and the ``prefetch`` before it (the
        backward's first reach), none without prefetching."""
        prefetch = self._owner().prefetch
        return prefetch + 1 if prefetch else 0

    def takes(self, nbytes: int, cls: tuple) -> bool:
        """Whether a compressed storage of ``nbytes`` of class ``cls`` joins a shared batch:
        whole pages, at most half a batch, of a class the ratio policy has decided (a sample
        is measured alone)."""
        off = self._owner()
        return (nbytes % off.page_size == 0 and nbytes <= BATCH_BYTES // 2
                and cls in off.policy.decided)

    def add(self, src: torch.Tensor, esize: int, ff: str | None,
            alone: tuple | None = None) -> tuple[_Entry, int]:
        """Hold ``src`` (``uint8 [n]``, a saved storage): in the open batch of its key, or
        with ``alone`` (``(codec, class)``) as a batch of its own. Returns ``(the batch's
        entry, src's byte offset in it)``. A full batch is closed first; then the oldest
        batches are stored while the GPU bytes held pass ``max_in_flight_bytes`` or the saved
        tensors ``max_in_flight_tensors`` (torchtune's ``max_fwd_stash_size``; held and
        stashed in one count, a batch's members each, ``_hooks.ActivationOffloader._bound``)."""
        off = self._owner()
        dev = src.device
        stream = current_stream(dev) if dev.type == "cuda" else None
        key = (dev, stream, ff, esize)
        batch = self.open.get(key) if alone is None else None
        entry = batch.ref() if batch is not None else None
        if batch is not None and (entry is None or batch.nbytes + src.numel() > BATCH_BYTES):
            self._close(batch)
            batch = None
        if batch is None:
            ps = off._pass
            entry = _Entry(off._sink, 0, dev, ps, len(ps.groups) - 1)
            entry.stream, entry.parts = stream, []
            if alone is None:  # several storages may join: each is restored on its own
                entry.member_refs = {}
            # in its group now: the group is not empty, so the next one starts a new group
            ps.groups[entry.group].append(weakref.ref(entry))
            batch = Batch(key, entry, alone, self._freed.append)
            if alone is None:
                self.open[key] = batch
            else:
                self.held.append(batch)
        base = batch.add(entry, src)
        if stream is not None:
            self.nbytes += src.numel()
        self.members += 1
        if self.window:
            off.counters["held"] += 1
        if self.behind:
            self.store_due()
        off._bound()
        off._group_bytes_add(src.numel())
        return entry, base

    def live(self) -> int:
        """Saved storages held whose saved tensors are alive (a batch whose are all freed is
        dropped at its store)."""
        batches = (*self.held, *self.open.values())
        return sum(b.members for b in batches if b.ref() is not None)

    def prune(self) -> None:
        """Take the batches whose saved tensors were all freed since the last prune off the
        books: their storages went with their entry, yet their members and bytes still counted
        against the in-flight bounds, which stored live batches and waited for the stash in
        their place until they were due. One check unless an entry was freed."""
        if not self._freed:
            return
        self._freed.clear()  # before the scan: an entry freed during it is seen next time
        for batch in [b for b in (*self.held, *self.open.values()) if b.ref() is None]:
            self.flush(batch)  # (of a freed batch: only off the books)

    def flush_oldest(self) -> None:
        """Store the oldest batch not stored (the in-flight bounds' last resort)."""
        self.flush(self.held[0] if self.held else next(iter(self.open.values())))

    def _close(self, batch: Batch) -> None:
        """No more members for ``batch``: held, or stored now without a window (nothing if
        it is no longer open: the bound of an earlier batch's store stored it)."""
        if self.open.get(batch.key) is not batch:
            return
        del self.open[batch.key]
        self.held.append(batch)
        if not self.window and not _capturing():
            self.flush(batch)

    def _close_open(self) -> None:
        """Close every open batch (:meth:`_close`)."""
        for batch in list(self.open.values()):
            self._close(batch)

    def end_group(self, ps) -> None:
        """At the end of a group of pass ``ps`` (a new one started): close the open batches
        and store those of groups outside the window, as far as the link keeps up
        (:meth:`store_due`)."""
        self._close_open()
        if ps.groups[-1]:  # (an empty group does not end: the next one is the same)
            self.last_group_bytes = ps.group_bytes
        ps.new_group()
        if not _in_backward():  # (a recompute's group in a backward stores nothing it reads)
            self.due = (weakref.ref(ps), len(ps.groups) - self.window)
            self.store_due()

    def end_pass(self) -> None:
        """At the end of a pass: close the open batches (stored now without a window)."""
        if self.window:
            self._close_open()
        else:
            self.flush_all()

    def store_due(self) -> None:
        """Store the batches due (of passes other than :attr:`due`'s and of its groups before
        its group), oldest first, while their device's allocation is over the line of
        :meth:`_over_peak` (below it they stay held) and each can start without the host
        waiting for the link. A compressed batch whose store would wait for slices in flight
        to be placed (``PagedStore.stores_now``: the arena's chunks are spoken for, the link
        is behind the forward) stays held, and those after it; they are tried again at the
        next saved storage and group end. Not in a backward (it reads held batches in place;
        a recompute's group stores nothing it reads), nor while a CUDA graph is captured (its
        launches and events would go into the graph)."""
        self.behind = False
        if self.due is None or _in_backward() or _capturing():
            return
        ref, group = self.due
        ps = ref()
        over: dict = {}  # device -> bytes above the line of :meth:`_over_peak` (asked once)
        holding = set()  # devices below that line: their due batches stay
        # the oldest due batch, found again after each store: a store's in-flight bound
        # (``_bound``) may have stored the next one already
        while (batch := next((b for b in self.held if b.before(ps, group)
                              and b.key[0] not in holding), None)) is not None:
            dev = batch.key[0]
            if dev not in over:
                over[dev] = self._over_peak(dev)
            if over[dev] is not None and over[dev] <= 0:
                holding.add(dev)
                self._flag_due(ps, group, "held_below_peak", dev)
                continue
            if not self._starts_now(batch):
                self.behind = True
                self._flag_due(ps, group, "deferred")
                return
            if over[dev] is not None:
                over[dev] -= batch.nbytes  # freed once its store has read it
            self.flush(batch)

    def _flag_due(self, ps, group: int, flag: str, dev: torch.device | None = None) -> None:
        """Set ``flag`` on the due batches (of ``dev`` only, if given) that lack it, and add
        their members to the offloader's counter of that name."""
        counters = self._owner().counters
        for b in self.held:
            if (b.before(ps, group) and (dev is None or b.key[0] == dev)
                    and not getattr(b, flag)):
                setattr(b, flag, True)
                counters[flag] += b.members

    def _over_peak(self, dev: torch.device) -> int | None:
        """None off a GPU; else the bytes by which the allocation of ``dev`` now, with room
        for two more groups like the last (the next group's saved storages, held until their
        group leaves the window, and its temporaries), exceeds the most the caching allocator
        has allocated since its peak was last reset. At most zero, the due batches stay held:
        see "Stored only to stay under the peak" in this module's docstring."""
        counts = gpu_memory(dev)
        if counts is None:
            return None
        allocated, peak = counts
        return allocated + 2 * self.last_group_bytes - peak

    def _starts_now(self, batch: Batch) -> bool:
        """Whether storing ``batch`` starts without the host waiting (anything but a
        compressed store on a GPU whose arena is spoken for; a batch whose saved tensors are
        all freed is dropped, not stored)."""
        dev = batch.key[0]
        copy = batch.alone is not None and batch.alone[0] is None
        if batch.ref() is None or dev.type != "cuda" or copy:
            return True
        off = self._owner()
        why = off._paged_store(dev).refusal(batch.nbytes)
        if why is not None:  # attempts, by reason (``deferred`` counts the members once)
            off.counters[f"refused_{why}"] += 1
        return why is None

    def flush_all(self) -> None:
        """Store every batch not stored, waiting for the link if need be (not while a CUDA
        graph is captured)."""
        self.behind = False
        if (self.open or self.held) and not _capturing():
            self._close_open()
            while self.held:
                self.flush(self.held[0])

    def flush_unheld(self) -> None:
        """Before an unpack or a prefetch: without a window, store every batch (a member
        unpacked first is then restored with its group); with one, the batches stay and
        their members are read in place."""
        if not self.window:
            self.flush_all()

    def _source(self, entry: _Entry, codec: str | None, ff: str | None) -> torch.Tensor | list:
        """What ``entry``'s store reads: its parts where they lie, for a compressed batch of
        several on a GPU whose store reads them so (``PagedStore.parts_problem``), else
        :func:`joined`."""
        parts = entry.parts
        if (codec is not None and len(parts) > 1 and entry.device.type == "cuda"
                and self._owner()._paged_store(entry.device).parts_problem(parts, ff) is None):
            return parts
        return joined(entry)

    def flush(self, batch: Batch) -> None:
        """Store ``batch`` as one entry (nothing if its saved tensors are all freed); if that
        fails, keep its members in place."""
        off = self._owner()
        if self.open.get(batch.key) is batch:
            del self.open[batch.key]
        else:
            self.held.remove(batch)
        if batch.key[1] is not None:  # a compute stream: GPU bytes
            self.nbytes -= batch.nbytes
        self.members -= batch.members
        entry = batch.ref()
        if entry is None:
            return
        _, _, ff, esize = batch.key
        codec, cls = batch.alone or ("exp" if ff else "lz4", None)
        entry.nbytes, entry.members = batch.nbytes, batch.members
        try:
            src = self._source(entry, codec, ff)  # (a join out of GPU memory: kept in place)
            stored = off._store(entry, src, esize, ff, codec, cls)
        except Exception as exc:  # noqa: BLE001 - the members stay where they are (unpack
            # serves each from its own storage while the entry lives): nothing lost
            off.counters["offload_failed"] += batch.members
            off._last_error = repr(exc)
            entry.error = exc.with_traceback(None)
            off._failed.add(entry)
            return
        if not stored:  # a plain copy with the pinned pool full: kept where it is
            off.counters["kept_host_full"] += batch.members
        elif batch.alone is None:
            off.counters["batched"] += batch.members
            if isinstance(src, list):
                off.counters["batched_in_place"] += batch.members
