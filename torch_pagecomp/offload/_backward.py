"""The backward half of :class:`torch_pagecomp.offload.ActivationOffloader`: unpack, prefetch
by group, restores on a side stream and the end-of-backward clean-up.

:class:`Backward` is a part the offloader owns (``offloader._backward``): it keeps what only the
backward uses (the autograd graph tasks it watches, whether restores are batched, the decode
failures already reported) and reaches the offloader's shared state (lock, stash, entries,
stores, counters) through a weak reference, so the two never form a reference cycle.

**The end of a backward and the end of the interpreter.** The offloader learns that a backward
ended from a callback it queues on the autograd engine (:class:`BackwardEnd`). The engine keeps
that Python object with the graph task and, when it frees the task, takes the GIL to let it
go. On a GPU the task may be freed on the engine's device thread just after ``backward()``
returned. A script that ends right there finalizes the interpreter meanwhile; that thread,
asking for the GIL of a finalizing interpreter, is stopped inside the engine and the process
aborts ("terminate called without an active exception": 1 exit in 20 of the exit script
``hooks_with_backward`` on an H200, ``bench/results/h200_session75``). So each callback
counts as live until freed, and at exit the interpreter waits, ``EXIT_WAIT_S`` at most, until
none is."""

from __future__ import annotations

import atexit
import os
import time
import warnings
import weakref

import torch

from .._events import handoff, mark
from ..format import CorruptPageError
from ._entry import SPLIT, _capturing, _Entry
from ._paged import PagedStored, SliceNotStored
from ._paged_group import StoredGroup, restore_placed
from ._streams import current_stream, on_stream

EXIT_WAIT_S = 5.0  # at interpreter exit, for the engine to free the callbacks it still holds


class BackwardEnd:
    """The callback :meth:`Backward._watch_backward` queues on the autograd engine for graph
    task ``task``: ends that backward for its :class:`Backward` (reached through a weak
    reference, if still alive). Live (in ``_ENDS``) until the engine frees it; see the
    module docstring."""

    __slots__ = ("_backward", "task", "__weakref__")

    def __init__(self, backward: Backward, task: int):
        self._backward, self.task = weakref.ref(backward), task
        _ENDS.add(self)

    def __call__(self) -> None:
        backward, task = self._backward(), self.task
        # an error raised below keeps this frame in its traceback (the caller may keep that
        # at exit: sys.last_traceback): not this object, which exit would wait for
        del self
        if backward is not None:
            backward._end_backward(task)


_ENDS: weakref.WeakSet[BackwardEnd] = weakref.WeakSet()  # callbacks the engine still holds


def wait_for_backward_ends(timeout: float = EXIT_WAIT_S) -> bool:
    """Wait, ``timeout`` seconds at most, until the autograd engine has freed every
    :class:`BackwardEnd` (it takes the GIL to: sleeping here lets it). Returns whether it
    has. Registered with ``atexit``."""
    deadline = time.monotonic() + timeout
    waited = False
    while len(_ENDS):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.0005)
        waited = True
    if waited:  # the engine frees the rest of the graph task just after the callbacks
        time.sleep(0.002)
    return True


atexit.register(wait_for_backward_ends)
# a forked child has none of the parent's engine threads: nothing of theirs to wait for
os.register_at_fork(after_in_child=_ENDS.clear)


class Backward:
    """Unpack and restore for one :class:`ActivationOffloader` (see the module docstring)."""

    def __init__(self, offloader):
        self._owner = weakref.ref(offloader)
        # autograd graph tasks whose end is watched, each with its callback (weakly): a
        # backward that raises never calls it, and the engine frees it with the task
        self.tasks: dict[int, weakref.ref] = {}
        self.batch_restores = True  # off for good if the batched decode ever fails to run
        self.failed_restores_seen = 0

    @property
    def off(self):
        """The offloader (alive while its hooks can call this)."""
        return self._owner()

    def unpack(self, packed):
        """The saved-tensor unpack hook: the tensor, restored or served from the stash."""
        off = self.off
        capturing = _capturing()
        if isinstance(packed, torch.Tensor):  # kept: still, the first unpack starts prefetching
            task = torch._C._current_graph_task_id()
            if off.prefetch and not capturing and task not in self.tasks:
                with off._lock:
                    self._watch_backward()
            return packed
        packed.check_version()
        if capturing:  # no side-stream work inside a CUDA graph capture
            if packed.entry.parts is not None:  # held where it is (``_batch``)
                return packed.view_parts(packed.entry.parts)
            if packed.entry.src is None:
                raise RuntimeError(
                    "activation offload: a tensor offloaded to host memory was unpacked during "
                    "CUDA graph capture; run the captured forward under keep_on_gpu()"
                )
            return packed.view(packed.entry.src.untyped_storage())
        with off._lock:
            entry = packed.entry
            off._batcher.flush_unheld()
            self._watch_backward(entry)
            if entry.parts is not None:  # held (``_batch``), or its store failed, or stored
                # from its parts, which the stash keeps (``PagedStore.takes_parts``): in place
                held = entry.stored is None and entry.error is None
                off.counters["served_held" if held else "served_from_stash"] += 1
                self._prefetch_from(entry.pass_, entry.group, entry)  # the groups before it
                parts = entry.parts
                if not held:
                    self._served(entry)
                return packed.view_parts(parts)
            if entry.src is not None:
                off.counters["served_from_stash"] += 1
                self._prefetch_from(entry.pass_, entry.group, entry)
                storage = entry.src.untyped_storage()
                self._served(entry)
                return packed.view(storage)
            self._prefetch_from(entry.pass_, entry.group, entry)
            if entry.restored is None:
                off._poll()
                self._restore_counted([entry], entry)
            # still under the lock: the end of a backward on another thread drops every
            # restore (``_end_backward``), which read here after it left the buffer None
            # (the unpack raised) or marked a later restore as waited for
            entry.check_restored()
            if entry.restore_event is not None:
                current = current_stream(entry.device)
                current.wait_event(entry.restore_event)
                if current != entry.stream:
                    entry.stream.wait_event(entry.restore_event)
                entry.waited = True
            if entry.restored is SPLIT:  # restored member by member (``_entry._Member``)
                m = packed.member
                if m is None or m.buf is None:
                    raise RuntimeError("activation offload: a batched saved tensor's member "
                                       "was not restored (internal error)")
                m.waited = entry.waited
                return packed.view(m.buf.untyped_storage(), m.base)
            return packed.view(entry.restored.untyped_storage())

    def _served(self, entry: _Entry) -> None:
        """``entry``'s source was handed back in place: it stays so for this backward, and
        leaves the stash now if its host copy is complete."""
        off = self.off
        entry.served = True
        if entry.ready() and entry in off._stash:
            off._stash.remove(entry)
            off._release(entry, wait=False, keep_served=True)

    def _prefetch_tail(self, entry: _Entry | None) -> None:
        """At the start of a backward: restore the last groups of the pass of ``entry`` (the
        offloaded tensor unpacked first), or where a kept tensor comes first, of the latest
        forward (so kept blocks' backward hides the first restores). Always the latest
        forward's, forwards interleaved (a pipeline's micro-batches, backwards in forward
        order) had each backward restore the newest pass's last groups, hold them to its end
        and drop them, for that pass's backward to restore them again."""
        off = self.off
        if entry is not None:
            ps = entry.pass_
        else:
            ps = off._last_pass() if off._last_pass is not None else None
        if ps is None or not off.prefetch:
            return
        for k in range(len(ps.groups) - 1, -1, -1):
            if any(r() is not None for r in ps.groups[k]):
                self._prefetch_from(ps, k, entry)
                return

    def _prefetch_from(self, ps, group: int, entry: _Entry | None) -> None:
        """Restore groups ``group .. group - prefetch`` of pass ``ps`` (not yet issued);
        ``entry``: the one being unpacked, if any (its restore is on demand, not a
        prefetch)."""
        off = self.off
        if off.prefetch == 0:
            return
        off._batcher.flush_unheld()  # a kept tensor's unpack may come first
        polled = False
        for k in range(group, max(-1, group - off.prefetch - 1), -1):
            if ps.issued[k]:
                continue
            ps.issued[k] = True
            if not polled:  # once per group issued, not at every unpack: host memory that
                off._poll()  # autograd released goes back, placements are confirmed
                polled = True
            todo = []
            for ref in reversed(ps.groups[k]):
                e = ref()
                if (e is not None and e.src is None and e.parts is None and e.restored is None
                        and e.stored is not None):
                    todo.append(e)
            if todo:  # one group at a time (batched restores stay within a group)
                try:
                    self._restore_counted(todo, entry)
                except BaseException:
                    # (its entries not restored are left so: a retried backward prefetches
                    # the group again rather than restoring them one by one on demand)
                    ps.issued[k] = False
                    raise

    def _restore_counted(self, entries: list[_Entry], unpacked: _Entry | None) -> None:
        """:meth:`restore`, counting the restores that ran: ``restored_on_demand`` for
        ``unpacked`` (the entry being unpacked), ``restored_prefetch`` for the others. After
        it, an entry holds a buffer exactly where its restore ran (or failed and says so):
        one stopped midway (an interrupt) is not counted, as its retry will be. Before, the
        counts were taken ahead of the restore (a stopped one counted twice), and an entry
        restored by its own unpack's group prefetch was counted as neither."""
        try:
            self.restore(entries)
        finally:
            ran = sum(e.restored is not None for e in entries)
            demand = unpacked is not None and unpacked.restored is not None and any(
                e is unpacked for e in entries)
            counters = self.off.counters
            if demand:
                counters["restored_on_demand"] += 1
            if ran > demand:  # (no key for none: stats() lists the counters that happened)
                counters["restored_prefetch"] += ran - demand

    def restore(self, entries: list[_Entry]) -> None:
        """Start restoring ``entries`` (in this order) into buffers allocated on each entry's
        compute stream; a side stream writes them after that stream's work so far.

        Compressed ones of one store and stream whose sizes are whole pages are restored in
        batches of up to ``RESTORE_BATCH_BYTES`` (``PagedStore.restore_group``: one staging
        buffer, one copy per run of adjacent host bytes, one decode over all their pages per
        codec, each page into its own tensor's buffer): per tensor that saves two decode
        launches, two allocations and a host-to-device copy of host time, and each tensor
        still lives only as long as autograd keeps it (a buffer shared by a group would live
        until the group's last tensor is used: the end of its block's backward, raising the
        peak). A batch of several saved storages is restored member by member
        (``_entry._Member``): each restore target is a tensor or ``(byte offset, buffer)``
        parts (kept here only: the entry holds no buffer of a member)."""
        issued: set[int] = set()  # ids of the entries whose restore ran (or failed and says so)
        try:
            self._restore(entries, issued)
        except BaseException:
            # stopped midway (out of memory allocating a buffer, a KeyboardInterrupt): an entry
            # whose restore did not run must not keep its unfilled buffer as ``restored``, or
            # a retried backward (retain_graph=True) would read it as the saved tensor (wrong
            # gradients, no error); left unrestored, it is restored again when unpacked
            cuda = next((e.device for e in entries if e.device.type == "cuda"), None)
            # their buffers go back to the allocator after the side stream's work so far
            event = mark(self.off._stream(cuda, "h2d")) if cuda is not None else None
            for e in entries:
                if id(e) not in issued:
                    if e.restored is not None:
                        e.restore_event, e.waited = event, False
                    for m in e.split_members() or ():  # (members given buffers before it
                        m.drop()  # stopped, the entry not yet marked SPLIT)
                    e.drop_restored()
            raise

    def _restore(self, entries: list[_Entry], issued: set[int]) -> None:
        """:meth:`restore`'s work; adds to ``issued`` the ids of the entries whose restore
        ran."""
        batches: dict[tuple, list[_Entry]] = {}
        outs: dict[int, torch.Tensor | list] = {}
        for e in entries:
            e.restore_event = None
            if e.restore_failed:  # an earlier restore's error, never raised (no unpack read
                # it: the backward stopped above it, or raised elsewhere): this restore's
                # outcome is what its unpack reads; kept, it failed a later backward whose
                # restore ran fine
                e.error, e.restore_failed = None, False
            members = e.split_members()  # a batch of several: a buffer per live member
            with on_stream(e.stream):
                if members is not None:
                    parts = outs[id(e)] = []
                    for m in members:
                        m.buf = torch.empty(m.nbytes, dtype=torch.uint8, device=e.device)
                        m.waited = False
                        parts.append((m.base, m.buf))
                    e.restored = SPLIT
                else:
                    e.restored = outs[id(e)] = torch.empty(e.nbytes, dtype=torch.uint8,
                                                           device=e.device)
            if e.device.type == "cpu":
                continue
            if (self.batch_restores and isinstance(e.stored, PagedStored)
                    and e.nbytes % e.stored.page_size == 0):
                batches.setdefault((id(e.store), e.stream), []).append(e)
        # a part of one entry restored member by member goes the batched way too: it decodes
        # into the members' buffers, where a single restore decodes into one buffer and then
        # copies each member out (6.8 ms of host time a step on BERT-large, sampled)
        part_of = {id(e): part for batch in batches.values() for part in _split(batch)
                   if len(part) >= BATCH_MIN_ENTRIES or part[0].restored is SPLIT
                   for e in part}
        gpu_streams = {e.stream for e in entries if e.device.type == "cuda"}
        side = self.off._stream(entries[0].device, "h2d") if gpu_streams else None
        with on_stream(side):
            for s in gpu_streams:  # the buffers were allocated there
                handoff(s, side)
            for e in entries:  # in the order given (the order backward needs them)
                part = part_of.get(id(e))
                if part is None:
                    self._restore_one(e, outs[id(e)], side)
                    issued.add(id(e))
                elif e is part[0]:
                    self.restore_batch(part, [outs[id(x)] for x in part], side)
                    issued.update(id(x) for x in part)

    def restore_batch(self, part: list[_Entry], outs: list, side) -> None:
        """Restore ``part`` (compressed, one store and stream) with one batched restore (of
        placed slices, ``_paged_group.restore_placed``, else a group restore); if the
        batched decode cannot run, turn batching off and restore them one by one. Its LZ4 and
        exponent-codec tensors (a bf16 model's fp32 and bf16 activations) are put together, so
        the group decodes once per codec (``_paged_group.codec_runs``). ``outs``: each
        entry's restore target (see :meth:`restore`)."""
        first = part[0]
        try:
            if not restore_placed(first.store, [e.stored for e in part], outs):
                # stable: order kept per codec
                group = sorted(zip(part, outs), key=lambda eo: eo[0].stored.exp)
                wholes = [_whole(e, out) for e, out in group]
                first.store.restore_group(StoredGroup(first.stored.page_size,
                                                      [e.stored for e, _ in group]), wholes)
                for (_, out), whole in zip(group, wholes):
                    _scatter(out, whole)
        except Exception as exc:  # noqa: BLE001 - one by one: only a failing tensor raises
            if not isinstance(exc, SliceNotStored):  # the batched decode itself failed
                self.batch_restores = False
                warnings.warn(f"activation offload: batched restores off after {exc!r}; "
                              "tensors are restored one by one", stacklevel=2)
            for e, out in zip(part, outs):
                self._restore_one(e, out, side)
            return
        event = mark(side)
        for e in part:
            e.restore_event = event

    def _restore_one(self, e: _Entry, out, side) -> None:
        try:
            whole = _whole(e, out)
            e.store.restore(e.stored, whole)
            _scatter(out, whole)
            if side is not None:
                e.restore_event = mark(side)
        except Exception as exc:  # noqa: BLE001 - raised at this entry's unpack
            if e.error is None:  # (an offload's error stays: that is the one to report)
                e.error, e.restore_failed = exc.with_traceback(None), True
            if side is not None:  # its buffer goes back after the work queued for it
                e.restore_event = mark(side)

    def _watch_backward(self, entry: _Entry | None = None) -> None:
        """At a backward's first unpack (of ``entry``, None for a kept tensor): watch for its
        end, and prefetch its tail (:meth:`_prefetch_tail`)."""
        task = torch._C._current_graph_task_id()
        if task != -1 and task not in self.tasks:
            end = BackwardEnd(self, task)
            self.tasks[task] = weakref.ref(end)
            torch.autograd.Variable._execution_engine.queue_callback(end)
            # the backward stores little: the stores' GPU scratch (payloads, the LZ4
            # compressor's working memory: 8-17 MiB) is not held through its peak (BERT-large's
            # peak had it, 9 MiB above a plain copy's, bench/results/h200x2_fd0815b_session57)
            for store in self.off._paged.values():
                store.release_scratch()
            self._prefetch_tail(entry)

    def watched(self) -> int:
        """The backwards whose end is still to come: a backward that raised is not among
        them (its callback never ran; its clean-up is the next backward's, which releases
        what the hooks still hold of it). The caller holds the offloader's lock."""
        for task, end in list(self.tasks.items()):
            if end() is None:
                self.tasks.pop(task, None)
        return len(self.tasks)

    def _end_backward(self, task: int) -> None:
        off = self.off
        if off is None:  # the offloader is gone: nothing of it is left to clean up
            return
        with off._lock:
            self.tasks.pop(task, None)
            off._batcher.flush_all()  # held storages this backward left alive: a kept graph's
            for ps in list(off._passes):
                ps.issued = [False] * len(ps.issued)
            for e in list(off._live):
                e.drop_restored()
            while off._stash:
                off._release(off._stash.popleft(), wait=True)
            # failed offloads keep their GPU storage (``src``, or a batch's ``parts``) as long
            # as the entry lives, i.e. as long as autograd keeps the saved tensor, as it would
            # keep the tensor itself: dropped here, a retained graph's next backward, or the
            # backward of a graph forwarded before this one ended, had nothing to serve them
            # from (their store failed) and raised
            off._failed.clear()
            off._poll()
            off.pool.shrink()  # the plain copies: chunks no recent step used
            for store in off._paged.values():
                store.arena.shrink()
                store.end_step()
        self._check_restores()

    def _check_restores(self) -> None:
        """Raise if a compressed restore failed to decode (seen without a host sync, so at the
        end of this backward or, at the latest, of the next one)."""
        failed = sum(store.failed_restores() for store in self.off._paged.values())
        if failed > self.failed_restores_seen:
            self.failed_restores_seen = failed
            raise CorruptPageError(
                [], [], f"{failed} page(s) of offloaded activations failed to decode on restore"
            )


def _whole(e: _Entry, out) -> torch.Tensor:
    """``e``'s restore target ``out`` as one buffer: itself, or for parts (an entry restored
    member by member) a temporary one on the current stream (the paths that decode a stored
    tensor into one output), whose bytes :func:`_scatter` then copies into the parts."""
    if isinstance(out, torch.Tensor):
        return out
    return torch.empty(e.nbytes, dtype=torch.uint8, device=e.device)


def _scatter(out, whole: torch.Tensor) -> None:
    """Copy the parts' bytes out of ``whole`` (:func:`_whole`), on the current stream."""
    if not isinstance(out, torch.Tensor):
        for base, buf in out:
            buf.copy_(whole[base:base + buf.numel()], non_blocking=True)


RESTORE_BATCH_BYTES = 64 << 20  # a batch's staging (its compressed bytes) is at most about
# what one large tensor's restore stages alone; 128 MiB (fewer batches, less host time) ran
# encoder-1024 slower in one A/B round (h200_66258a2_hostpath): a tensor's decode waits for
# all the copies of its batch


BATCH_MIN_ENTRIES = 2  # a part of fewer entries is restored slice by slice (PagedStore.restore)


def _split(batch: list[_Entry]) -> list[list[_Entry]]:
    """``batch`` cut, in order, into parts of at most ``RESTORE_BATCH_BYTES`` (a larger
    tensor is a part alone)."""
    parts, size = [[]], 0
    for e in batch:
        if parts[-1] and size + e.nbytes > RESTORE_BATCH_BYTES:
            parts.append([])
            size = 0
        parts[-1].append(e)
        size += e.nbytes
    return parts

