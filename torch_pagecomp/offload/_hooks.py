"""Training-loop activation offload: saved-tensor hooks that send activations to host memory.

``with offload_activations(...):`` (or ``_wrap.offload_module``) installs
``torch.autograd.graph.saved_tensors_hooks``. The unit of offload is a tensor's whole *storage*
(views and shared storages are offloaded once and rebuilt with their exact sizes, strides and
offsets, so gradients are bit-identical):

* pack: parameters (and views / autocast casts of them), small tensors, CPU tensors, tensor
  subclasses and regions under :func:`keep_on_gpu` stay as they are. Other storages start an
  asynchronous offload after the compute stream, issued from the hook itself (no host thread,
  no host sync): compressed pages written by kernels straight into page-locked host memory
  (``_paged``), or (``mode="uncompressed"``, or a ``(dtype, shape)`` class whose
  sampled ratio is below ``min_ratio``, or a pass where ``prefer="speed"``'s step tuner found
  copying faster: ``_tune``) a copy into page-locked memory carved at its size on a side
  stream. With prefetching, a storage is held where it is until its group leaves the last
  ``prefetch + 1`` groups (``_batch``): the backward's first prefetch would bring those back at
  once, so it reads them in place and their bytes never cross the link; a compressed store
  whose slices would make the host wait for the link (it is behind the forward) is put off,
  its storages held, until a later saved storage finds the link free; and a due storage stays
  held while the GPU's allocation (with room for two more groups) is below the peak the
  caching allocator has already reached: memory the process uses each step anyway, so
  storing it would lower nothing and cost its round trip. The GPU storage of a
  started offload stays in a stash until its store has read it: until a plain copy is done,
  until a compressed store's pages are compressed (their pack into host memory may still run;
  a backward that needs them first waits for it on the GPU). A backward that comes first
  reads the storages still there in place, with no round trip over the link; past
  ``max_in_flight_bytes``
  (held storages included) the compute stream waits until the oldest has been read (copied,
  or compressed: a GPU-side wait) and it is dropped. Compressed storages of whole pages, up to
  half of ``_batch.BATCH_BYTES``, of a class the ratio policy has decided, are stored
  together, one entry per batch (``_batch``): a compressed offload costs the host about the
  same whatever its size.
* groups: a pass (one outermost ``with``) is cut into groups at every :meth:`next_group` (each
  block's forward with :func:`offload_module`) and every ``group_bytes``.
* unpack: the first unpack in group ``k`` restores groups ``k .. k - prefetch`` on a side
  stream into buffers allocated on the compute stream; the compute stream waits on each
  buffer's event before using it, so restored tensors may escape (checkpoint recompute, hooks)
  without ``record_stream``. Tensors still in the stash are handed back without a round trip.
* lifetime: host copies belong to the saved-tensor objects autograd holds: they are freed when
  autograd releases them (after backward, or when the graph is dropped). The end of each
  backward drops unused prefetches and the stash; :meth:`pending` then reports nothing.
"""

from __future__ import annotations

import collections
import threading
import time
import warnings
import weakref

import torch

from .._args import check_flag, check_int, check_number
from .._events import handoff
from ..format import DTYPE_FLOAT_FORMATS, check_page_size, dtype_element_size
from ..pools import can_pin
from ._backward import Backward
from ._batch import Batcher
from ._copy_arena import PinnedCopyArena
from ._entry import (
    _capturing,
    _Entry,
    _in_backward,
    _is_param_like,
    _Packed,
    _Pass,
    _tls,
    keep_on_gpu,
)
from ._ledger import HostLedger
from ._paged import PagedStore
from ._stores import ClassPolicy, CpuStore, PinnedStore
from ._streams import current_stream, on_stream
from ._tune import StepTuner

MODES = ("compressed", "uncompressed")
CODECS = ("auto", "lz4")  # what ActivationOffloader(codec=...) takes


class ActivationOffloader:
    """Saved-tensor hooks that offload activations; use as a (reusable) context manager.

    One thread at a time runs forwards inside it (torch keeps saved-tensor hooks per thread:
    a second thread entering while the first is inside raises; make one offloader per
    thread); backward may run on any thread. A saved tensor changed in place after it was
    offloaded raises at its unpack, as autograd does without hooks.

    Args:
        mode: ``"compressed"`` (compressed pages in host memory, per-class fallback to a pinned
            copy) or ``"uncompressed"`` (stream-overlapped pinned copies only).
        codec: the compressed pages' codec. ``"auto"`` (default): each ``(dtype, shape)``
            class of bfloat16 / float16 tensors samples the exponent codec
            (``torch_pagecomp.exp_codec``: 1.42x on typical bf16 activations) and LZ4 +
            bit-shuffle (smaller where most values are zero) and keeps the one that stores it
            smaller (``ClassPolicy``; ``stats()["policy"]``); every
            other dtype goes through LZ4 bit-shuffled by its element size; ``"lz4"``: LZ4 for
            every dtype. Both are lossless for any bytes; a batched restore of a group that holds
            both (a bf16 model under autocast saves fp32 and bf16 tensors side by side)
            decodes once per codec. ``stats()`` counts the storages each codec stored
            (``compressed_exp`` / ``compressed_lz4`` and their ``_bytes``). With
            ``offload_cpu``, CPU tensors follow the same choice.
        prefetch: the first unpack in group ``k`` restores groups ``k .. k - prefetch``. The
            last ``prefetch + 1`` groups of a forward, which the backward needs first, are
            held where they are and read there: a group is stored only once it leaves that window
            and the GPU's allocation, with room for two more groups, is over the peak the
            caching allocator has reached since its peak was last reset (0: nothing held,
            each tensor restored on demand when unpacked).
        min_offload_bytes: storages smaller than this stay where they are.
        max_in_flight_bytes: GPU bytes kept alive by unfinished offloads and held storages
            (with the compressors' scratch); past it the oldest held are stored and the
            compute stream waits until the oldest has been read (copied, or compressed), a
            GPU-side wait.
        max_in_flight_tensors: the same bound as one count of saved tensors whose offload is
            unfinished: those in the stash and those held (waiting in a batch included)
            together; held ones are also stored once they alone reach it, so that no batch,
            stored as one entry, holds more (None: none).
        group_bytes: a new prefetch group starts once a group holds this many bytes (None: only
            at :meth:`next_group`).
        min_ratio, sample_tensors: a ``(dtype, shape)`` class stays compressed only if its first
            ``sample_tensors`` tensors compressed by at least ``min_ratio``.
        offload_cpu: also offload CPU tensors (compressed pages of ``codec``'s choice, packed
            on the CPU, when compressed; else a copy); by default CPU tensors are kept.
        keep_param_casts: keep autocast copies of parameters (``ToCopy`` of a leaf) in place.
        page_size: bytes per compressed page; max_pinned_bytes: bound on the page-locked memory of
            uncompressed copies (past it a tensor stays on the GPU).
        prefer: ``"speed"``: compress only where it shortens the step. Passes are timed
            (``_tune.StepTuner``: after eight warm-up passes, two passes each compressed
            and copied, again after ``tuner.retune`` passes, twice as long each time the
            choice holds, up to 16x, and on a new workload that lasts eight passes; a
            pass of another size is timed at the trials' bytes) and the faster way is kept
            (checked against the steps it gives: a choice whose own steps lose to the
            other way's trials, or come within 20% of them, has the other way's steps timed
            too, and the faster steps decide).
            ``"memory"``: every tensor of a class that compresses goes through the kernels.
        tuner: the ``StepTuner`` of ``prefer="speed"`` (default ``StepTuner()``).
        stream_priority: CUDA priority of the side streams (lower is higher).
        checksum: compressed offloads keep each page's checksum (format) and every restore
            checks its pages against them: a page restored to other bytes than were saved
            raises (on a GPU ``CorruptPageError`` at the end of that backward, with the decode
            failures; on the CPU at its unpack) instead of reaching the gradients silently.
            One more read of each tensor each way (a partial last page: as one zero-padded page).
    """

    def __init__(
        self,
        mode: str = "compressed",
        prefetch: int = 1,
        min_offload_bytes: int = 1 << 20,
        max_in_flight_bytes: int = 1 << 30,
        max_in_flight_tensors: int | None = None,
        group_bytes: int | None = 256 << 20,
        min_ratio: float = 1.1,
        sample_tensors: int = 2,
        offload_cpu: bool = False,
        keep_param_casts: bool = True,
        page_size: int = 4096,
        max_pinned_bytes: int | None = None,
        prefer: str = "speed",
        stream_priority: int = 0,
        tuner: StepTuner | None = None,
        checksum: bool = False,
        codec: str = "auto",
    ):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if codec not in CODECS:
            raise ValueError(f"codec must be one of {CODECS}, got {codec!r}")
        self.codec = codec
        if prefer not in ("speed", "memory"):
            raise ValueError(f"prefer must be 'speed' or 'memory', got {prefer!r}")
        self.prefer = prefer
        self.tuner = None
        self._released: str | None = None  # the checked choice whose other way's idle
        # memory was given back (``_tuned_arm``)
        self._made = 0  # host buffers and chunks made so far, as of the last pass's start
        if prefer == "speed" and mode == "compressed":
            self.tuner = tuner if tuner is not None else StepTuner()
        elif tuner is not None:  # it would never be asked: say so rather than drop it
            raise ValueError("tuner is used only with prefer='speed' and mode='compressed' "
                             f"(got prefer={prefer!r}, mode={mode!r})")
        self.stream_priority = stream_priority
        # every setting checked here, by name: a bad one left to the hooks failed each offload
        # (kept in place, said only in a warning), so a step ran with nothing offloaded
        check_int("prefetch", prefetch, 0)
        check_int("min_offload_bytes", min_offload_bytes, 0)
        check_int("max_in_flight_bytes", max_in_flight_bytes, 0)
        check_int("max_in_flight_tensors", max_in_flight_tensors, 1, none_ok=True)
        check_int("group_bytes", group_bytes, 1, none_ok=True)
        check_int("sample_tensors", sample_tensors, 1)
        check_int("max_pinned_bytes", max_pinned_bytes, 0, none_ok=True)
        check_int("stream_priority", stream_priority)
        check_number("min_ratio", min_ratio)  # (0: every class compressed)
        check_flag("offload_cpu", offload_cpu)
        check_flag("keep_param_casts", keep_param_casts)
        check_flag("checksum", checksum)
        check_page_size(page_size)
        self.mode, self.prefetch = mode, prefetch
        self.min_offload_bytes, self.max_in_flight_bytes = min_offload_bytes, max_in_flight_bytes
        self.max_in_flight_tensors = max_in_flight_tensors
        self.group_bytes, self.offload_cpu = group_bytes, offload_cpu
        self.keep_param_casts, self.page_size = keep_param_casts, page_size
        self.policy = ClassPolicy(sample_tensors, min_ratio)
        # page-locked memory carved at exact sizes (no power-of-two rounding), any size from
        # the chunks already pinned (``_copy_arena``)
        self.pool = PinnedCopyArena(pin=can_pin(), max_bytes=max_pinned_bytes)
        self._pinned = PinnedStore(self.pool)
        self._cpu = CpuStore(compress=False)
        self.checksum = checksum
        self._cpu_compressed = CpuStore(compress=True, page_size=page_size, checksum=checksum)
        self._paged: dict[int, PagedStore] = {}
        self._closed_pins = 0  # arena chunks the stores let go by close() had made
        self._last_error: str | None = None  # the latest offload that failed (kept in place)
        self._streams: dict[tuple, torch.cuda.Stream] = {}
        self._lock = threading.RLock()
        self._sink: list = []
        self._stash: collections.deque[_Entry] = collections.deque()
        self._stash_bytes = 0
        self._stash_tensors = 0  # saved storages the stash holds (a batch holds several)
        self._bounding = False  # in _bound (a store it starts tracks its entry)
        self._failed: weakref.WeakSet[_Entry] = weakref.WeakSet()  # offloads that failed: their
        # storage stays with the entry (on the GPU) as long as the entry lives; listed here until
        # the end of backward
        self._live: weakref.WeakSet[_Entry] = weakref.WeakSet()
        self._passes: weakref.WeakSet[_Pass] = weakref.WeakSet()
        self._pass: _Pass | None = None
        self._last_pass: weakref.ref | None = None
        self._depth = 0
        self._owner: int | None = None  # the thread inside the outermost ``with``
        self._hooks = None
        self._keep_ptrs: set[int] = set()
        # weakly: an offloader kept (or reused for another model) without remove() kept every
        # model it had hooked alive, their GPU parameters included
        self._keep_modules: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
        self._handles: list = []
        self._ledger = HostLedger()  # stored bytes of live entries, and their peak
        self.counters = collections.Counter()
        # host seconds spent inside the hooks (stats()["host_s"]): set against a step's time,
        # they say whether the hooks' host work is what the step waits for
        self._host_s = {"pack": 0.0, "unpack": 0.0}
        self._pass_start = collections.Counter()
        self._warned_idle = False
        self._backward = Backward(self)  # unpack, prefetch and restores
        self._batcher = Batcher(self)  # small storages stored together

    # ----------------------------------------------------------------- context manager
    def __enter__(self) -> ActivationOffloader:
        with self._lock:
            me = threading.get_ident()
            if self._depth and self._owner != me:
                # torch keeps saved-tensor hooks per thread, this offloader one pass: a second
                # thread's forward got no hooks, and the last to leave removed hooks it never
                # installed (an internal assert in torch, and the other thread's hooks left on)
                raise RuntimeError(
                    "this ActivationOffloader is inside a forward on another thread: use one "
                    "offloader per thread that runs forwards (backward may run anywhere)")
            if self._depth == 0:
                self._owner = me
                self._batcher.flush_all()  # the storages an earlier pass held: stored now
                arm = self._tuned_arm()
                self._pass = _Pass(compress=arm == "compress")
                self._passes.add(self._pass)
                self._last_pass = weakref.ref(self._pass)
                self._keep_ptrs = {
                    ptr
                    for m in self._keep_modules
                    for t in (*m.parameters(), *m.buffers())
                    if (ptr := _storage_ptr(t)) is not None
                }
                # every saved tensor keeps both hooks until it is freed: the bound ``_pack``
                # keeps the offloader alive for its backward (a user need not hold it)
                self._hooks = torch.autograd.graph.saved_tensors_hooks(
                    self._timed_pack, self._timed_unpack)
                self._hooks.__enter__()
                self._pass_start = self.counters.copy()
            self._depth += 1
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0:
                try:
                    self._batcher.end_pass()
                finally:  # the hooks come off whatever happens there (an interrupt in a
                    # store): left on, every later saved tensor of this thread went on into
                    # this pass, offloaded outside any ``with``, and they stayed on for good
                    self._hooks.__exit__(*exc)
                    self._hooks = self._pass = self._owner = None
                self._warn_if_nothing_offloaded()

    def _warn_if_nothing_offloaded(self) -> None:
        """Once per offloader: a pass saved tensors yet offloaded none. Say why and what to
        pass, rather than silently doing nothing."""
        if self._warned_idle:
            return
        delta = self.counters - self._pass_start
        if delta["packed"] == 0 or delta["offloaded_bytes"] > 0:
            return
        self._warned_idle = True
        why = []
        if delta["kept_cpu"]:
            why.append(f"{delta['kept_cpu']} were CPU tensors (pass offload_cpu=True to "
                       "offload those)")
        if delta["kept_small"]:
            why.append(f"{delta['kept_small']} were smaller than min_offload_bytes="
                       f"{self.min_offload_bytes} (pass a smaller min_offload_bytes)")
        if delta["offload_failed"]:
            why.append(f"{delta['offload_failed']} offloads failed and stayed in place "
                       f"(latest: {self._last_error})")
        kept = {k[5:]: v for k, v in delta.items()
                if k.startswith("kept_") and k not in ("kept_cpu", "kept_small")}
        deferred, below = delta["deferred"], delta["held_below_peak"]
        if below:
            why.append(f"{below} were held in place because the GPU's allocation stayed below "
                       "the peak it had already reached (storing them would not lower it)")
        if delta["held"] > deferred + below:
            why.append(f"{delta['held'] - deferred - below} were held in place, not stored: "
                       "they are "
                       f"in the last prefetch + 1 = {self.prefetch + 1} groups, which the "
                       "backward would bring back at its start (start a group per block with "
                       "next_group(), as offload_module does, or pass a smaller group_bytes)")
        if deferred:
            why.append(f"{deferred} were held in place because the link was still busy with "
                       "earlier stores when they were due")
        if kept:
            why.append(f"others were kept: {kept}")
        warnings.warn(
            f"offload_activations: {delta['packed']} saved tensors, none offloaded: "
            + "; ".join(why),
            stacklevel=3,
        )

    def _tuned_arm(self) -> str:
        """This pass's arm (``prefer="speed"``). Once the tuner's choice is checked (its
        settled passes confirmed it), the idle memory of the other way is released: plain
        copies' pooled buffers when compressing wins (classes that do not compress regrow
        what they use); when copying wins, the compressors' idle host chunks and their GPU
        scratch, which would otherwise stay allocated and shrink the in-flight bound of every
        copied pass (more waits, fewer storages served in place). Not before the check: a
        choice it takes back would pin all of it again. Every copied pass, a trial too, runs
        without the compressors' GPU scratch (made again by the next compressed pass): a
        copied trial is timed under the bound it would have once chosen. With the scratch
        subtracted, the copied trials of encoder-2048 and llama-2048 (steps at the bound) ran
        7-8% slower than the `uncompressed` variant's steps
        (bench/results/h200x2_055904c_stock), and the tuner kept compressing where copying
        was faster."""
        if self.tuner is None or _capturing() or torch.compiler.is_compiling():
            return "compress"  # no events recorded into a graph capture or a trace
        made = self.host_buffers_made()
        arm = self.tuner.start_pass(grew=made != self._made)  # the pass now closing
        self._made = made
        final = None if self.tuner.checking else self.tuner.choice
        if final != self._released:
            if final == "compress":
                self.pool.clear()
            elif final == "copy":
                for store in self._paged.values():
                    store.release_idle()
            # only once given back: a release that raised is tried again at the next pass
            self._released = final
        if arm == "copy":
            for store in self._paged.values():
                # settled: also the chunks the last compressed passes' tensors still held at
                # the decision, given back once freed (encoder-2048 kept 0.81 GiB pinned on
                # copied steps without); release_idle frees the scratch too
                if final == "copy" and store.arena.held_bytes:
                    store.release_idle()
                else:
                    store.release_scratch()
        return arm

    def host_buffers_made(self) -> int:
        """Page-locked host buffers made so far: plain copies' pooled buffers and the
        compressors' arena chunks (a pass that made one paid milliseconds for it)."""
        return (self.pool.misses + self._closed_pins
                + sum(st.arena.pins for st in self._paged.values()))

    def next_group(self) -> None:
        """Start a new prefetch group (e.g. at each transformer block's forward) in the pass
        of the calling thread; on another thread (an evaluation's forward beside training, in
        a block with this hook), nothing: its blocks cut the training thread's groups."""
        if (self._pass is not None and self._owner == threading.get_ident()
                and not _in_backward()):
            with self._lock:
                self._batcher.end_group(self._pass)

    def keep_on_gpu(self):
        """Same as the module-level :func:`keep_on_gpu`."""
        return keep_on_gpu()

    # --------------------------------------------------------------------------- pack
    def _keep_reason(self, t: torch.Tensor) -> str | None:
        # runs for every saved tensor (hundreds a step): cheap checks first, no device object
        if _tls.keep:
            return "region"
        if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout != torch.strided:
            return "subclass"
        if t.is_conj() or t.is_neg():
            return "subclass"
        if t.is_quantized:  # its scale and zero point live outside its bytes
            return "quantized"
        if t.is_cuda:
            if torch.compiler.is_compiling() or _capturing():
                return "capture"
        elif not t.is_cpu:
            return "device"
        elif not self.offload_cpu:
            return "cpu"
        if _is_param_like(t, self.keep_param_casts):
            return "param"
        storage = t.untyped_storage()
        if storage.data_ptr() in self._keep_ptrs:
            return "param"
        if storage.nbytes() < max(1, self.min_offload_bytes):
            return "small"
        return None

    def _timed_pack(self, t: torch.Tensor):
        t0 = time.perf_counter()
        try:
            out = self._pack(t)
            # a tensor kept as it is goes back detached (autograd puts its grad_fn back at
            # unpack): a node's output it saves holds that node through its grad_fn, a cycle
            # through C++ that no collector sees, so a graph dropped without a backward (a
            # forward that raised, an evaluation under grad) was never freed, nor the
            # storages and host copies of everything it had saved (torch's saved-tensor
            # hooks docs ask for ``detach`` there). A leaf (a parameter, an input) has no
            # grad_fn: kept as it is, no cost
            return t.detach() if out is t and not t.is_leaf else out
        finally:  # no lock: packs run on the one thread inside the ``with`` (see __enter__)
            self._host_s["pack"] += time.perf_counter() - t0

    def _timed_unpack(self, packed):
        t0 = time.perf_counter()
        try:
            return self._backward.unpack(packed)
        finally:  # backwards may run on several threads at once
            dt = time.perf_counter() - t0
            with self._lock:
                self._host_s["unpack"] += dt

    def _pack(self, t: torch.Tensor):
        with self._lock:
            self.counters["packed"] += 1
            reason = self._keep_reason(t)
            if reason is not None or self._pass is None:
                self.counters[f"kept_{reason or 'outside'}"] += 1
                return t
            storage = t.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes(), t.device)
            hit = self._pass.dedup.get(key)
            if hit is not None:
                first, entry = hit[0](), hit[1]()
                if (
                    entry is not None
                    and first is not None
                    and first._version == t._version == hit[2]
                ):
                    self.counters["deduplicated"] += 1
                    return _Packed(entry, t, hit[3], entry.member(hit[3], key[1]), hit[4])
            # only before a new offload: a storage saved again (a quarter to a third of the
            # storages a ResNet or transformer block saves) needs nothing the poll settles
            self._poll()
            src, witness = _storage_bytes(t, storage)
            try:
                placed = self._offload(t, storage, src)
            except Exception as exc:  # noqa: BLE001 - the tensor stays where it is: nothing lost
                self.counters["offload_failed"] += 1
                self._last_error = repr(exc)
                return t
            if placed is None:
                self.counters["kept_host_full"] += 1
                return t
            entry, base = placed
            self._pass.dedup[key] = (weakref.ref(t), weakref.ref(entry), t._version, base,
                                     witness)
            return _Packed(entry, t, base, entry.member(base, key[1]), witness)

    def _offload(self, t: torch.Tensor, storage: torch.UntypedStorage, src: torch.Tensor
                 ) -> tuple[_Entry, int] | None:
        """Start offloading ``storage`` (``t``'s; ``src``: its bytes, :func:`_storage_bytes`):
        ``(entry, byte offset of the storage in the entry's bytes)``, or None where the pinned
        pool is full."""
        ps = self._pass
        nbytes, dev = storage.nbytes(), t.device
        if self.tuner is not None:  # the pass's workload: the bytes taken, stored or not (the
            # bytes stored differ by arm: a compressed pass reads what the link has not taken
            # in place, and the tuner took the difference for a new workload, trial after trial)
            self.tuner.add_bytes(nbytes)
        esize = dtype_element_size(t.dtype)
        cls = (t.dtype, tuple(t.shape))
        # 16-bit floats under ``codec="auto"``: the exponent codec or LZ4 + bit-shuffle, the
        # class's samples decide which (``ClassPolicy``); else LZ4 + bit-shuffle
        exp_ok = self.codec == "auto" and t.dtype in DTYPE_FLOAT_FORMATS
        codecs = ("exp", "lz4") if exp_ok else ("lz4",)
        codec = (self.policy.choose(cls, codecs) if self.mode == "compressed" and ps.compress
                 else None)
        compress = codec is not None
        ff = DTYPE_FLOAT_FORMATS[t.dtype] if codec == "exp" else None
        if compress and self._batcher.takes(nbytes, cls):
            return self._batcher.add(src, esize, ff)
        if self._batcher.window:  # held until its group leaves the backward's first reach
            return self._batcher.add(src, esize, ff, alone=(codec, cls))
        entry = _Entry(self._sink, nbytes, dev, ps, len(ps.groups) - 1)
        entry.stream = current_stream(dev) if dev.type == "cuda" else None
        if not self._store(entry, src, esize, ff, codec, cls):
            return None
        ps.groups[entry.group].append(weakref.ref(entry))
        self._group_bytes_add(nbytes)
        return entry, 0

    def _store(self, entry: _Entry, src: torch.Tensor | list, esize: int, ff: str | None,
               codec: str | None, cls: tuple | None) -> bool:
        """Start storing ``src`` (``uint8 [entry.nbytes]``: a saved storage, or a batch's
        members joined; or ``entry.parts`` themselves, compressed where they lie, where the
        GPU's store takes them: ``PagedStore.takes_parts``) as ``entry``, after
        ``entry.stream``'s work, with ``codec`` (None: a plain copy); then count it, sample it
        for ``cls``'s ratio (a class, None for a batch) and track it. False where the pinned
        pool is full; a failing store raises."""
        dev = entry.device
        if dev.type == "cpu":
            entry.store = self._cpu_compressed if codec is not None else self._cpu
            entry.stored = self._store_cpu(entry.store, src, esize, ff)
        elif codec is not None:
            entry.store = self._paged_store(dev)
            entry.stored = entry.store.offload(src, esize, producer=entry.stream,
                                               float_format=ff)
        else:
            side = self._stream(dev, "d2h")
            with on_stream(side):
                handoff(entry.stream, side)
                entry.stored = self._pinned.offload(src, esize)
            if entry.stored is None:
                return False
            entry.store = self._pinned
        if codec is not None and cls is not None:
            self.policy.sample(cls, entry.stored, codec)
        self._count(entry, ff)
        self._track(entry, src)
        # a batch's members are let go only now: should the book-keeping above raise, the
        # caller keeps the entry as failed and unpack serves each member from them
        if src is not entry.parts:  # (parts read where they lie stay until read: ``_track``)
            entry.parts = None
        return True

    @staticmethod
    def _store_cpu(store, src: torch.Tensor, esize: int, ff: str | None):
        """``src`` stored by a CPU store (with ``ff``: the exponent codec's pages); called
        without ``ff`` where there is none, as stores patched in by tests take it."""
        return store.offload(src, esize, ff) if ff else store.offload(src, esize)

    def _count(self, entry: _Entry, ff: str | None) -> None:
        """Count the saved storages ``entry`` stores (``members``, ``nbytes`` in all)."""
        tensors, nbytes = entry.members, entry.nbytes
        if entry.store.kind == "compressed":
            name = "compressed_exp" if ff else "compressed_lz4"
            self.counters[name] += tensors
            self.counters[name + "_bytes"] += nbytes
        self.counters[f"offloaded_{entry.store.kind}"] += tensors
        self.counters["offloaded_bytes"] += nbytes

    def _track(self, entry: _Entry, src: torch.Tensor | list) -> None:
        """Book-keep a started offload: a GPU source (``entry.src``, or the parts a batch is
        stored from, ``entry.parts``) stays in the stash until its store has read it
        (``_poll``; waiting for the oldest past ``max_in_flight_bytes``); its stored size in
        the ledger."""
        if entry.device.type == "cuda":
            self._stash_add(entry, src)
        entry.host_rec = self._ledger.add(entry.stored, entry.nbytes)
        self._live.add(entry)

    def _stash_add(self, entry: _Entry, src: torch.Tensor | list) -> None:
        """Keep ``entry``'s source (``src``, or the parts it is stored from) in the stash until
        its store has read it, then keep the in-flight bounds (:meth:`_bound`)."""
        if src is not entry.parts:
            entry.src = src
        self._stash.append(entry)
        self._stash_bytes += entry.nbytes
        self._stash_tensors += entry.members
        self._bound()

    def _bound(self) -> None:
        """Keep the GPU bytes of unfinished offloads and held storages (``_batch``) within
        ``max_in_flight_bytes``, and their saved tensors, the stash's and the held ones' in
        one count, within ``max_in_flight_tensors``, the oldest first: a stashed storage is
        older than a held one, so the compute stream waits for it to be read (a GPU-side
        wait; the newest is kept, as waiting for the copy just queued would end the overlap),
        then the oldest held one is stored (on a GPU into the stash, where the next turn waits
        for what is older). Held storages are also stored once they alone reach
        ``max_in_flight_tensors``: the next one may join their batch, which stored as one
        entry, the newest (never waited for), would pass the bound by itself. So on return
        both bounds hold, unless nothing is held and the stash's one entry passes one alone
        (a storage larger than ``max_in_flight_bytes``). Batches whose saved tensors were all
        freed are taken off the books first (``Batcher.prune``): their storages are gone."""
        if self._bounding:  # a store below tracks its entry: bounded by this loop
            return
        self._bounding = True
        try:
            held, most, limit = self._batcher, self.max_in_flight_tensors, self._in_flight_limit()
            held.prune()
            # each turn drops a stashed entry or stores a held batch (adding at most one
            # entry to the stash): it ends
            while True:
                over = self._stash_bytes + held.nbytes > limit
                many = full = False
                if most is not None:  # (a held batch stored moves its count to the stash)
                    many = self._stash_tensors + held.members > most
                    full = held.members >= most
                if len(self._stash) > 1 and (over or many):
                    self.counters["in_flight_waits"] += 1
                    self._release(self._stash_victim(), wait=True)
                elif held.members and (over or many or full):
                    held.flush_oldest()
                else:
                    break
        finally:
            self._bounding = False

    def _in_flight_limit(self) -> int:
        """GPU bytes the stash may hold: the compressors' scratch counts against the same
        bound."""
        return self.max_in_flight_bytes - sum(st.scratch_bytes for st in self._paged.values())

    def _group_bytes_add(self, nbytes: int) -> None:
        ps = self._pass
        ps.group_bytes += nbytes
        if self.group_bytes is not None and ps.group_bytes >= self.group_bytes:
            self._batcher.end_group(ps)

    def _release(self, entry: _Entry, wait: bool, keep_served: bool = False) -> None:
        """Drop the stash's hold on ``entry``'s GPU storage (its copy is done, or ``wait``).
        A failed offload keeps it (unpack serves it) as long as the entry lives. With
        ``keep_served`` (in a backward), a storage already handed back in place becomes the
        entry's restored copy: a tensor saved twice (one storage, two unpacks) is then not
        brought back over the link for its second unpack."""
        if wait:
            try:
                entry.checked_stored().wait_on(entry.stream)
            except Exception as exc:  # noqa: BLE001 - kept on the GPU instead
                entry.error = entry.error or exc.with_traceback(None)
        if entry.failed():
            self.counters["offload_failed"] += entry.members  # saved storages, as elsewhere
            self._failed.add(entry)
        else:
            if keep_served and entry.served and entry.restored is None:
                entry.restored = entry.src  # on the compute stream already: nothing to wait for
                # parts a batch was stored from stay, read in place until the backward ends
                entry.parts_served = entry.parts is not None
            else:
                entry.parts = None
            entry.src = None
        self._stash_bytes -= entry.nbytes
        self._stash_tensors -= entry.members

    def _stash_victim(self) -> _Entry:
        """The oldest entry (its release is a GPU-side wait)."""
        return self._stash.popleft()

    def _poll(self) -> None:
        # Stores read their sources in the order they were issued (one side stream each way),
        # so only the oldest stashed entries are looked at: O(released) per hook, not
        # O(stash). In a forward a source goes once its store has read it: a compressed one
        # once its pages are compressed, while the pack may still write them to host memory
        # (held to the end of the pack, the slice being packed was a whole slice more at
        # the ResNets' forward peak). During a backward a stashed storage is kept until served
        # in place (released when its copy finished, it would be read back over the link
        # instead); served ones go once stored.
        for store in self._paged.values():  # first: a confirmed slice needs no event query
            store.poll()
        stash = self._stash
        if _in_backward():
            while stash and stash[0].served and stash[0].ready():
                self._release(stash.popleft(), wait=False, keep_served=True)
        else:
            while stash and stash[0].source_read():
                self._release(stash.popleft(), wait=False)
        self.policy.poll()
        while self._sink:
            store, stored, rec = self._sink.pop()
            if rec is not None:
                self._ledger.remove(rec)  # before the free: its size is read from ``stored``
            if stored is not None:
                store.free(stored)
        self._ledger.settle()  # sizes the kernels placed since

    # ------------------------------------------------------------------------ helpers
    def _stream(self, dev: torch.device, name: str) -> torch.cuda.Stream:
        key = (dev.index if dev.index is not None else torch.cuda.current_device(), name)
        if key not in self._streams:
            self._streams[key] = torch.cuda.Stream(device=key[0], priority=self.stream_priority)
        return self._streams[key]

    def _paged_store(self, dev: torch.device) -> PagedStore:
        """The compressed store of ``dev`` (made on first use), with its side streams."""
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        if index not in self._paged:
            streams = tuple(self._stream(dev, name) for name in ("d2h", "pack", "h2d"))
            self._paged[index] = PagedStore(torch.device("cuda", index), self.page_size, streams,
                                            checksum=self.checksum)
        return self._paged[index]

    def synchronize(self) -> None:
        """Wait until every offload started so far is stored; drop the stash's GPU storages."""
        with self._lock:
            self._batcher.flush_all()
            while self._stash:
                self._release(self._stash.popleft(), wait=True)
            self._poll()

    def close(self) -> None:
        """Give back what this offloader holds between uses: wait for every offload and
        restore in flight, then unpin its page-locked host memory (the plain copies' buffers
        and the compressed stores' chunks) and free the compressors' GPU memory. It stays
        usable: a later offload pins and allocates again. Raises ``RuntimeError`` while
        tensors it offloaded are still saved (a graph not yet run backward or dropped): their
        bytes are in that memory. Unpinning waits for the whole GPU (``cudaHostUnregister``),
        so call this between steps, not inside one; without it the memory goes when the
        offloader is collected, at whatever moment that is."""
        with self._lock:
            self.synchronize()
            live = self.pending()["entries"]
            if live:
                raise RuntimeError(f"ActivationOffloader.close: {live} offloaded saved tensors "
                                   "are still alive; run their backward or drop their graph "
                                   "first")
            for store in self._paged.values():
                self._closed_pins += store.arena.pins  # host_buffers_made never goes down
                store.close()
            self._paged.clear()
            self.pool.clear()

    def reset_peak_stats(self) -> None:
        """Start the peaks of :meth:`stats` (host bytes, host memory held) from now."""
        with self._lock:
            self._poll()
            self._ledger.reset_peak()
            for store in self._paged.values():
                store.arena.reset_peaks()

    def host_bytes(self) -> int:
        """Host bytes held now by live offloaded storages (compressed sizes once known)."""
        total = 0
        for e in list(self._live):
            size = e.stored.host_nbytes() if e.stored is not None else None
            total += e.nbytes if size is None else size
        return total

    def pending(self) -> dict:
        """What the hooks still hold; every value is 0 after a finished backward."""
        with self._lock:
            self._poll()
            live = list(self._live)
            return {
                "entries": len(live),
                "stash": len(self._stash),
                "stash_bytes": self._stash_bytes,
                "holding": self._batcher.live(),  # storages held now (``held``: so far)
                "failed": len(self._failed),
                "restored": sum(e.restored is not None for e in live),
                "host_bytes": self.host_bytes(),
                "pinned_in_use_bytes": self.pool.in_use_bytes,
                "backward_callbacks": self._backward.watched(),
            }

    def stats(self) -> dict:
        """Counters (packed / kept by reason / offloaded / restores), bytes and policy.

        ``host_s``: ``{"pack": s, "unpack": s}``, the host seconds spent inside the pack and
        unpack hooks so far (prefetching restores included). Their growth over a training
        step, set against the step's time, says how much of the step is the hooks' host work:
        near all of it, the host is what the step waits for (fewer, larger saved tensors, or
        ``prefer="speed"``, help there; a faster link or codec does not).

        ``batched``: saved storages stored as members of a batch (several small compressed
        storages stored as one entry, ``_batch``); counted in ``offloaded_compressed`` too;
        ``batched_in_place`` those of them compressed where they lay (on a GPU), not joined.
        ``held``: saved storages held where they were at first (with prefetching, every one
        offloaded; those of the last ``prefetch + 1`` groups are never stored), and
        ``served_held`` the unpacks that read one in place; ``holding`` (of :meth:`pending`)
        those held now. ``deferred``: held storages whose compressed store was put off at
        least once because the link was behind the forward (``_batch.Batcher.store_due``);
        ``held_below_peak``: held storages whose store was put off at least once because the
        GPU's allocation was below the peak it had reached (``_batch.Batcher._over_peak``).
        ``refused_room`` / ``refused_backlog`` / ``refused_payload``: the attempts at such a
        store that were put off, by the reason (``PagedStore.refusal``: the arena's room,
        the link's backlog, or the GPU behind the host with the next payload).
        ``entries`` and ``stash`` count stored entries, a batch once."""
        with self._lock:
            # the counters after pending()'s poll, in one snapshot: a store found failed there
            # (``_release``) was in ``failed`` and not yet in ``offload_failed``
            pending = self.pending()
            out = dict(self.counters)
            out["host_s"] = dict(self._host_s)
        for key in ("packed", "offloaded_bytes"):  # read by every user: there from the start
            out.setdefault(key, 0)
        out.update(pending)
        out["peak_host_bytes"] = self._ledger.peak
        if self._last_error is not None:
            out["last_offload_error"] = self._last_error
        out["pinned_held_bytes"] = self.pool.held_bytes
        out["policy"] = self.policy.summary()
        if self.tuner is not None:
            out["tuner"] = self.tuner.summary()
        if self._paged:
            out["compressor"] = {k: st.stats() for k, st in self._paged.items()}
        return out

    def keep_tensors_of(self, module: torch.nn.Module) -> None:
        """Never offload ``module``'s parameters and buffers (or views of them). Calling it
        again for the same module changes nothing (TRL's ``update_model_params``, this under
        another name, may be called at every step: each ``with`` walks the kept modules).
        ``module`` is held weakly (the offloader keeps no model alive): pass one the caller
        keeps, not a container made for the call (``nn.ModuleList([a, b])``), which is
        collected at once and keeps nothing."""
        if not isinstance(module, torch.nn.Module):
            raise ValueError(f"keep_tensors_of takes a torch.nn.Module, got "
                             f"{type(module).__name__}")
        self._keep_modules.add(module)

    def remove(self) -> None:
        """Take off the module hooks installed by :func:`offload_module` (and by
        ``get_act_offloading_ctx_manager``), ending the passes and closing the ``keep``
        regions a forward interrupted on the calling thread left open; the modules given to
        :meth:`keep_tensors_of` are forgotten."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._keep_modules.clear()


def _storage_ptr(t: torch.Tensor) -> int | None:
    """The address of ``t``'s storage; a sharded parameter (FSDP2's DTensor) gives its local
    shard's, a tensor without storage (meta, a subclass without one) None."""
    local = getattr(t, "_local_tensor", None)
    t = local if local is not None else t
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def _storage_bytes(t: torch.Tensor, storage: torch.UntypedStorage
                   ) -> tuple[torch.Tensor, weakref.ref | None]:
    """``(src, witness)``: ``uint8 [storage.nbytes()]`` over ``t``'s whole storage, and a
    weak reference to ``src`` where it shares ``t``'s version counter (a view of
    ``t.detach()``; else None, a storage not a whole number of ``t``'s elements). Held in
    place (``_batch``) or in the stash, ``src`` is what a backward reads: an in-place change
    of the saved tensor there reaches the gradients. Autograd does not check versions under
    saved-tensor hooks, and the saved tensor itself (``_Packed.source``) may be gone by the
    backward (a temporary view, its base a forward's local): the handles check the witness's
    version while it lives, so such a change raises as it does without hooks, not silently
    read."""
    n, esize = storage.nbytes(), t.element_size()
    if n % esize == 0:
        try:
            src = t.detach().as_strided((n // esize,), (1,), 0).view(torch.uint8)
            return src, weakref.ref(src)
        except RuntimeError:  # (a layout as_strided refuses: a plain view of the bytes)
            pass
    return torch.empty((0,), dtype=torch.uint8, device=t.device).set_(storage), None


def offload_activations(**settings) -> ActivationOffloader:
    """``with offload_activations(mode=..., prefetch=...):`` offloads the activations saved
    inside. Takes the settings of :class:`ActivationOffloader`."""
    return ActivationOffloader(**settings)
