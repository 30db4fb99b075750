"""Book-keeping of the activation offloader: passes, groups, entries and packed handles."""

from __future__ import annotations

import contextlib
import threading
import weakref

import torch


class _Local(threading.local):
    keep = 0  # keep_on_gpu depth of this thread (a class default: read on every saved tensor,
    # where getattr with a default on a thread-local costs a caught AttributeError)


_tls = _Local()


@contextlib.contextmanager
def keep_on_gpu():
    """Inside this context no offloader moves saved tensors: they stay where they are."""
    _tls.keep += 1
    try:
        yield
    finally:
        _tls.keep -= 1


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


_HAS_CUDA: list[bool] = []


def _capturing() -> bool:
    """True while the current CUDA stream is capturing a graph (False without CUDA)."""
    if not _HAS_CUDA:
        _HAS_CUDA.append(torch.cuda.is_available())
    return _HAS_CUDA[0] and torch.cuda.is_current_stream_capturing()


def _is_param_like(t: torch.Tensor, keep_casts: bool) -> bool:
    """A parameter, a leaf requiring grad, a view of one, or (``keep_casts``) a dtype cast of
    one (what autocast saves for a linear layer)."""
    base = t._base
    if base is None:
        base = t
    if base.is_leaf:  # a parameter is a leaf: most saved tensors (not leaves) skip the
        # isinstance, which goes through Parameter's metaclass
        return base.requires_grad or isinstance(base, torch.nn.Parameter)
    fn = base.grad_fn
    # the node's class name is its name (ToCopyBackward0), without building a string
    if keep_casts and fn is not None and type(fn).__name__.startswith("ToCopyBackward"):
        nxt = fn.next_functions
        return bool(nxt) and nxt[0][0] is not None and "AccumulateGrad" in nxt[0][0].name()
    return False


class _Pass:
    """The groups of one outermost ``with``: ``groups[k]`` holds weak references to entries."""

    __slots__ = ("groups", "group_bytes", "issued", "dedup", "compress", "__weakref__")

    def __init__(self, compress: bool = True):
        self.compress = compress  # False: this pass copies (``_tune.StepTuner``'s arm)
        self.groups: list[list[weakref.ref]] = [[]]
        self.group_bytes = 0
        self.issued = [False]
        self.dedup: dict[tuple, tuple] = {}

    def new_group(self) -> None:
        if self.groups[-1]:
            self.groups.append([])
            self.issued.append(False)
            self.group_bytes = 0


class _Split:
    """:data:`SPLIT`'s type."""

    def __repr__(self) -> str:
        return "SPLIT"


SPLIT = _Split()  # an entry's ``restored`` when its members were restored each on its own


class _Member:
    """One storage of a batch of several (``_batch``), shared by its saved tensors' handles
    (``_Packed.member``): a restore of the batch gives each member a buffer of its own, held
    here and so only by those handles. It goes back to the allocator when autograd releases
    the member's last saved tensor, where one buffer for the batch lived until its last
    member was used: on BERT-large the restored batches at the backward's peak held 0.24 GiB
    against a plain copy's 0.21 (one H200, ``bench.dev_peak_owners``). A member whose saved
    tensors are all freed is not restored at all."""

    __slots__ = ("entry", "base", "nbytes", "buf", "waited", "__weakref__")

    def __init__(self, entry: _Entry, base: int, nbytes: int):
        self.entry, self.base, self.nbytes = entry, base, nbytes
        self.buf: torch.Tensor | None = None
        self.waited = False  # the compute stream waited for the restore that wrote ``buf``

    def drop(self) -> None:
        """Let ``buf`` go (:meth:`_Entry.hand_back`)."""
        if self.buf is not None:
            self.entry.hand_back(self.waited)
        self.buf = None
        self.waited = False

    def __del__(self):
        try:
            self.drop()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class _Entry:
    """One offloaded storage: ``uint8 [nbytes]`` on ``device``. The hook that makes it sets
    ``stored`` before anything else can see the entry, and issues its restores, under the
    offloader's lock: nothing waits on another thread for them."""

    def __init__(self, sink: list, nbytes: int, device: torch.device, pass_: _Pass, group: int):
        self.sink, self.nbytes, self.device = sink, nbytes, device
        self.pass_, self.group = pass_, group
        self.stream = None  # compute stream at pack time (owner of the source and restores)
        self.src: torch.Tensor | None = None  # the GPU storage while its copy may run
        # the members of a batch not stored (``_batch``): ``(byte offset, bytes)`` each, read
        # in place while held, and as long as the entry lives if its store failed; of a batch
        # stored from them where they lie, while the stash keeps them (as ``src``), and
        # through a backward that served them in place
        self.parts: list[tuple[int, torch.Tensor]] | None = None
        self.store = self.stored = None
        self.error: BaseException | None = None
        self.restore_failed = False  # ``error`` is a restore's (raised once), not the offload's
        self.restored: torch.Tensor | None = None
        self.restore_event = None
        self.waited = False
        self.served = False  # handed back from the stash (in place) at least once
        self.parts_served = False  # ``parts`` out of the stash, kept as served in place
        self.host_rec = None  # its record in the offloader's host ledger
        self.members = 1  # saved storages it holds (a batch's, ``_batch``)
        # a batch open to several storages: byte offset -> weak reference to its _Member
        self.member_refs: dict[int, weakref.ref] | None = None

    def member(self, base: int, nbytes: int) -> _Member | None:
        """The :class:`_Member` of the storage at byte ``base`` (``nbytes`` long), shared by
        its saved tensors' handles; None for an entry that is not a batch of several."""
        refs = self.member_refs
        if refs is None:
            return None
        ref = refs.get(base)
        m = ref() if ref is not None else None
        if m is None:
            m = _Member(self, base, nbytes)
            refs[base] = weakref.ref(m)
        return m

    def split_members(self) -> list[_Member] | None:
        """The members a restore gives buffers of their own (:class:`_Member`), in byte
        order: those whose saved tensors are alive, where the entry is a batch of several;
        None to restore it into one buffer."""
        refs = self.member_refs
        if refs is None or len(refs) < 2:
            return None
        live = [m for r in refs.values() if (m := r()) is not None]  # added in byte order
        return live or None

    def checked_stored(self):
        """``stored``, or the error of the offload that did not store it."""
        if self.error is not None:
            raise RuntimeError(f"activation offload failed: {self.error}") from self.error
        return self.stored

    def failed(self) -> bool:
        failed = getattr(self.stored, "failed", None)
        return self.error is not None or (failed is not None and failed())

    def ready(self) -> bool:
        return self.stored is None or self.stored.ready()

    def source_read(self) -> bool:
        """Its store no longer reads the GPU source: a compressed store's pages are
        compressed (packing them into host memory may still run), a copy is done."""
        return self.stored is None or self.stored.source_read()

    def check_restored(self) -> None:
        """Raise the error of a restore that failed. A restore's own error is raised once and
        its unfilled buffer dropped: the next unpack (a retried backward) restores the entry
        again, as a failure that passed (out of memory) should not fail every retry."""
        error = self.error
        if error is not None:
            if self.restore_failed:
                self.error, self.restore_failed = None, False
                self.drop_restored()
            raise RuntimeError(f"activation restore failed: {error}") from error

    def hand_back(self, waited: bool) -> None:
        """Before a restored buffer is freed: its block returns to the compute stream after
        the restore that writes it, unless that stream has ``waited`` for it already."""
        if not waited and self.restore_event is not None:
            self.stream.wait_event(self.restore_event)

    def drop_restored(self) -> None:
        if self.parts_served:  # stored from its parts, served in place (``_hooks._release``)
            self.parts, self.parts_served = None, False
        if self.restored is SPLIT:
            for m in self.split_members() or ():
                m.drop()
        elif self.restored is not None:
            self.hand_back(self.waited)
        self.restored = self.restore_event = None
        self.waited = False

    def __del__(self):
        try:
            self.drop_restored()
        finally:
            if self.stored is not None or self.host_rec is not None:
                self.sink.append((self.store, self.stored, self.host_rec))


class _Packed:
    """What autograd keeps for one offloaded saved tensor: its entry and how to view it, and
    the tensor's version when it was saved. ``base``: the byte offset of the tensor's storage
    in the entry's bytes (a batch of storages, ``_batch``: page-aligned, so a whole number of
    elements of any dtype); ``member``: that storage's :class:`_Member` in a batch of several
    (its restored bytes), else None."""

    __slots__ = ("entry", "member", "dtype", "size", "stride", "offset", "source", "version",
                 "witness")

    def __init__(self, entry: _Entry, t: torch.Tensor, base: int = 0,
                 member: _Member | None = None, witness: weakref.ref | None = None):
        self.entry, self.member = entry, member
        self.dtype, self.size, self.stride = t.dtype, t.size(), t.stride()
        self.offset = t.storage_offset() + base // t.element_size()
        # torch checks a saved tensor's version at unpack only without saved-tensor hooks: an
        # in-place change after the save would go unnoticed, and the backward would read the
        # bytes offloaded before it. A weak reference: the offloaded tensor is not kept. A
        # view's base instead: it shares the view's version counter and lives at least as
        # long (the view holds it), where a temporary view saved (``x[:, :k].sin()``) dies
        # with the forward and its base's in-place change then went unseen
        root = t._base
        self.source, self.version = weakref.ref(t if root is None else root), t._version
        # the bytes of the storage held in place or in the stash, sharing its version counter
        # (``_hooks._storage_bytes``): alive while the backward would read them there, the saved
        # tensor and its base perhaps gone
        self.witness = witness

    def check_version(self) -> None:
        """Raise as autograd does if the saved tensor was changed in place since its save
        (known while the tensor, the base of a view, or the bytes the backward would read
        in place are alive)."""
        t = self.source()
        if t is None and self.witness is not None:
            t = self.witness()
        if t is not None and t._version != self.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: {self.dtype} {list(self.size)} is at version {t._version}; "
                f"expected version {self.version} instead (it was offloaded by "
                "torch_pagecomp's activation hooks at that version)")

    def view(self, storage: torch.UntypedStorage, base: int = 0) -> torch.Tensor:
        """The saved tensor on ``storage``, which holds the entry's bytes from byte ``base``
        on."""
        out = torch.empty((0,), dtype=self.dtype, device=storage.device)
        return out.set_(storage, self.offset - base // self.dtype.itemsize, self.size,
                        self.stride)

    def view_parts(self, parts: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
        """The saved tensor on the member of ``parts`` (``(byte offset, bytes)`` each, in
        order) that holds its first element."""
        at = self.offset * self.dtype.itemsize
        base, src = next((b, p) for b, p in reversed(parts) if b <= at)
        return self.view(src.untyped_storage(), base)
