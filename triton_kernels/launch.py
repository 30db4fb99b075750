"""How every launcher starts its kernel: traced (through ``torch.library.wrap_triton``) or direct.

Inside a ``triton_op`` (``torch.ops.pagecomp.*``) a kernel goes through ``wrap_triton`` so that
``torch.compile`` and ``make_fx`` can trace it; in eager mode the op turns that off and the kernel
launches directly. An eager caller that calls a launcher itself (the pipeline, on its own streams)
passes ``traced=False``: a ``wrap_triton`` kernel called outside an op goes through PyTorch's
higher-order-op dispatch, which costs several times a direct launch's host time.

A direct launch goes through ``JITFunction.run`` once per specialisation and then calls the
compiled kernel's launcher itself (:func:`_launch_compiled`): ``JITFunction.run`` rebinds the
arguments, reads Triton's environment-backed settings and rebuilds its cache key on every call,
which is most of a launch's host time; the activation-offload hooks launch a handful of kernels
per saved tensor, so that time is paid hundreds of times per training step.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os

import torch
from torch.library import wrap_triton


class FrozenMeta(dict):
    """A launch's keyword arguments that never change: a launcher builds one per configuration
    once (:func:`frozen_meta`) and the direct path keys its cache on the object, not on its
    items (hashing two dozen items per launch is measurable on the hooks' hot path)."""

    __slots__ = ()
    __hash__ = object.__hash__

    def _frozen(self, *args, **kwargs):
        raise TypeError("FrozenMeta is shared by every launch of its configuration: copy it")

    __setitem__ = __delitem__ = update = pop = popitem = setdefault = clear = _frozen


@functools.cache
def frozen_meta(items: tuple) -> FrozenMeta:
    """The one :class:`FrozenMeta` of ``items`` (``(name, value)`` pairs of plain constants)."""
    if _meta_key(dict(items)) is None:
        raise TypeError(f"launch settings must be plain constants: {items!r}")
    return FrozenMeta(items)


def config_meta(cfg, skip: tuple = (), extra: tuple = ()) -> dict:
    """The launch keyword arguments of a frozen dataclass of settings ``cfg``: its fields but
    ``skip``, then the ``(name, value)`` pairs of ``extra``. Eager: the shared
    :class:`FrozenMeta`. Traced by ``torch.compile``: a plain dict built field by field (older
    Dynamo releases cannot build one from a frozen dataclass's ``__dict__``)."""
    if not torch.compiler.is_compiling():
        return _frozen_config_meta(cfg, skip, extra)
    meta = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in skip}
    for name, value in extra:
        meta[name] = value
    return meta


@functools.cache
def _frozen_config_meta(cfg, skip: tuple, extra: tuple) -> FrozenMeta:
    return frozen_meta(tuple((f.name, getattr(cfg, f.name)) for f in dataclasses.fields(cfg)
                             if f.name not in skip) + extra)


def interpreting() -> bool:
    """Whether Triton runs kernels on the CPU (``TRITON_INTERPRET=1``): no inline PTX, and
    launchers pick settings that cost the interpreter fewer operations. Read at each launch,
    never at import, so import order changes nothing."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def launch(kernel, grid: tuple[int, ...], device: torch.device, args: tuple, meta: dict,
           traced: bool = True) -> None:
    """Launch ``kernel[grid](*args, **meta)`` on ``device``'s current stream.

    ``args`` are the kernel's leading parameters in order (tensors, ints, floats, bools, None);
    ``meta`` names the rest (constexprs, launch options such as ``num_warps``).
    """
    if traced:
        fn = wrap_triton(kernel)[grid]
    elif device.type == "cuda" and not torch.compiler.is_compiling() and not interpreting():
        index = torch._C._cuda_getDevice()
        if device.index is None or device.index == index:
            _launch_compiled(kernel, grid, index, args, meta)
            return
        with torch.cuda.device(device):  # Triton launches on the current device's stream
            _launch_compiled(kernel, grid, device.index, args, meta)
        return
    else:
        fn = kernel[grid]
    if (device.type == "cuda" and not torch.compiler.is_compiling()
            and device.index is not None and device.index != torch.cuda.current_device()):
        with torch.cuda.device(device):
            fn(*args, **meta)
    else:  # on the current device already (the common case: no switch), or compiled code,
        fn(*args, **meta)  # which sets the device itself


# (id(kernel), device index, meta items, per-argument specialisation) -> (the kernel, kept so
# that its id is not reused while cached; the compiled kernel's launch function; the
# arguments it takes before the kernel's; the parameter values after ``args``), or None where
# the compiled kernel cannot be called directly. Keyed by id: a JITFunction hashes in Python.
_COMPILED: dict = {}
_INT32 = (-(1 << 31), 1 << 31)


def _arg_class(a) -> tuple | None:
    """What of an argument can change the kernel Triton compiles for it, at least as finely as
    Triton's own specialisation: a tensor's dtype and 16-byte alignment; an int's equality to 1,
    divisibility by 16 and width. None: a kind of argument the direct path does not handle."""
    entry = _arg_entry(a)
    return None if entry is None else entry[0]


def _arg_entry(a) -> tuple | None:
    """``(`` :func:`_arg_class` ``, what the direct path hands the launcher)``: a CUDA tensor
    goes as its address (read for the class anyway), anything else as it is; None: a kind of
    argument the direct path does not handle."""
    if isinstance(a, torch.Tensor):
        ptr = a.data_ptr()
        return (a.dtype, not ptr & 15), (ptr if a.is_cuda else a)
    t = type(a)
    if t is int:
        return int_class(a), a
    if t is bool or t is float or a is None:
        return ((t, a) if t is bool else (t,)), a
    return None


def int_class(a: int) -> tuple:
    """:func:`_arg_class` of an int argument: its equality to 1, divisibility by 16, width."""
    return (a == 1, a & 15 == 0, _INT32[0] <= a < _INT32[1], a < 1 << 63)


def ptr_class(dtype: torch.dtype, ptr: int) -> tuple:
    """:func:`_arg_class` of a tensor argument of ``dtype`` at address ``ptr``, for launchers
    that pass addresses (:func:`launch_known`) without making the tensor (a view costs the
    host a few microseconds, several per stored slice)."""
    return (dtype, not ptr & 15)


def known_args(args: tuple) -> tuple[tuple, tuple]:
    """``(classes, values)`` of a launch's ``args`` for :func:`launch_known`, by the direct
    path's one rule (:func:`_arg_entry`): each argument's class, and what the launcher is
    handed for it. The arguments must be of the kinds the direct path takes."""
    entries = [_arg_entry(a) for a in args]
    return tuple(e[0] for e in entries), tuple(e[1] for e in entries)


def launch_known(kernel, grid: tuple[int, ...], index: int, meta: FrozenMeta, classes: tuple,
                 values: tuple, args, stream=None) -> None:
    """Launch ``kernel[grid](*args, **meta)`` directly on CUDA device ``index`` (the current
    device) and its current stream (or ``stream``, a ``torch.cuda.Stream`` of that device),
    for the activation store's hot path: ``classes`` and ``values`` are :func:`known_args`
    of ``args``, ``meta`` the :class:`FrozenMeta` the kernel's own launcher uses. ``args``
    may be a function that returns them: it is called only when the launch goes the usual
    way, which the first launch of these classes, one while Triton's launch hooks are set,
    and one on another device do. This skips the checks of :func:`launch` and of the
    kernel's launcher, which the store's arguments always pass."""
    entry = kept_entry(kernel, index, meta, classes)
    if entry is None or not entries_usable(index):
        if callable(args):
            args = args()
        if stream is None:
            launch(kernel, grid, torch.device("cuda", index), args, meta, traced=False)
        else:
            with torch.cuda.stream(stream):
                launch(kernel, grid, torch.device("cuda", index), args, meta, traced=False)
        return
    launch_entry(entry, grid, index, values,
                 None if stream is None else stream.cuda_stream)


def launch_cached(cache: dict, key, kernel, grid: tuple[int, ...], index: int, meta: FrozenMeta,
                  classes, values: tuple, args, stream) -> None:
    """:func:`launch_known` on ``stream`` (a ``torch.cuda.Stream``) for a caller that keeps the
    compiled entries itself, in ``cache`` by ``key``: a cheap stand-in that determines the
    arguments' classes, which ``classes`` (a function) gives only on a miss. For the small
    store's launches (``torch_pagecomp.offload._small_store``), where the layers of the
    launchers cost a small offload and restore tens of microseconds (#26)."""
    entry = cache.get(key)
    if entry is not None and entries_usable(index):
        launch_entry(entry, grid, index, values, stream.cuda_stream)
        return
    known = classes()
    launch_known(kernel, grid, index, meta, known, values, args, stream)
    cache[key] = kept_entry(kernel, index, meta, known)


def kept_entry(kernel, index: int, meta: FrozenMeta, classes: tuple) -> tuple | None:
    """The compiled kernel the direct path keeps for ``kernel`` on device ``index`` with
    ``meta`` and arguments of ``classes`` (:func:`known_args`), as :func:`launch_known` finds
    it, for a caller that launches it again and again through :func:`launch_entry` (one
    small call's plans, #26); None until a
    launch of these went the usual way (which compiles it), or where it cannot be called
    directly."""
    return _COMPILED.get((id(kernel), index, meta, classes)) or None


def entries_usable(index: int) -> bool:
    """Whether kept entries may launch on device ``index`` now: no Triton launch hooks set
    (its profiler's: the usual way calls them) and ``index`` the current device."""
    return not _hooks_set() and torch._C._cuda_getDevice() == index


def launch_entry(entry: tuple, grid: tuple[int, ...], index: int, values, raw_stream=None
                 ) -> None:
    """Launch a cached compiled kernel (:func:`_direct_entry`) on device ``index``'s current
    stream (or the CUDA stream ``raw_stream``) with the launcher's ``values``
    (:func:`_arg_entry`)."""
    _, fn, head, tail = entry
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    if raw_stream is None:
        raw_stream = torch._C._cuda_getCurrentRawStream(index)
    fn(grid[0], g1, g2, raw_stream, *head, *values, *tail)


def _meta_key(meta: dict) -> tuple | None:
    """``meta`` as a key, or None if a value is not a plain constant (a tensor there would be
    kept alive, and hashed by identity, by the cache)."""
    items = tuple(meta.items())
    for _, v in items:
        if type(v) not in (int, bool, float, str, type(None)):
            return None
    return items


def _launch_compiled(kernel, grid: tuple[int, ...], index: int, args: tuple, meta: dict) -> None:
    """Launch on device ``index``'s current stream through the cached compiled kernel; the first
    launch of each specialisation (and any launch the cache cannot key, or while Triton's launch
    hooks are set, e.g. under its profiler) goes through ``JITFunction.run``.

    A CUDA tensor goes to the launcher as its address (an int): given the tensor, Triton's C
    launcher calls its ``data_ptr`` and asks the driver whether the address is a device one
    (``cuPointerGetAttribute``), per pointer argument and launch; the classes below read the
    address anyway, and a CUDA tensor's is one. Other tensors (page-locked host memory) go as
    they are, so the launcher still refuses a pageable host tensor with an error."""
    # a FrozenMeta keys by identity (equal settings built apart only cost a second entry)
    mkey = meta if type(meta) is FrozenMeta else _meta_key(meta)
    if mkey is None or _hooks_set():
        kernel[grid](*args, **meta)
        return
    entries = [_arg_entry(a) for a in args]
    if None in entries:
        kernel[grid](*args, **meta)
        return
    key = (id(kernel), index, mkey, tuple(e[0] for e in entries))
    entry = _COMPILED.get(key, False)
    if entry is False:
        compiled = kernel[grid](*args, **meta)
        _COMPILED[key] = _direct_entry(kernel, compiled, index, args, meta)
        return
    if entry is None:
        kernel[grid](*args, **meta)
        return
    launch_entry(entry, grid, index, [e[1] for e in entries])


def _direct_entry(kernel, compiled, index: int, args: tuple, meta: dict):
    """``(kernel, launch function, its arguments between the stream and ``args``, values of the
    parameters after ``args``)``: what ``JITFunction.run`` passes to the compiled kernel's
    launcher besides the grid, the stream and ``args``, or None if this Triton's objects do not
    look as expected (then every launch keeps going through ``JITFunction.run``). Where the
    launcher is Triton 3.6's ``CudaLauncher`` with no scratch to allocate, its C launch
    function itself (:func:`_raw_launch`)."""
    try:
        binder = kernel.device_caches[index][-1]
        bound = binder(*args, **meta)[0]
        values = list(bound.values())
        run, function = compiled.run, compiled.function
        if not callable(run) or function is None or len(values) < len(args):
            return None
        tail, packed = tuple(values[len(args):]), compiled.packed_metadata
        raw = _raw_launch(run)
        if raw is None:  # function, metadata, no launch metadata, no hooks
            return kernel, run, (function, packed, None, None, None), tail
        launch_fn, cooperative, pdl = raw
        # function, cooperative grid, PDL, no scratch (global, profile), then as above
        return (kernel, launch_fn, (function, cooperative, pdl, None, None, packed, None, None,
                                    None), tail)
    except (AttributeError, IndexError, KeyError, TypeError):
        return None


# Triton 3.6's CudaLauncher.__call__(gridX, gridY, gridZ, stream, function, *args) allocates
# the scratch a kernel asks for (none of ours does) and calls its C launch function with
# (grid, stream, function, cooperative, pdl, global scratch, profile scratch, *args), args
# being (packed metadata, launch metadata, enter hook, exit hook, kernel arguments...)
_CUDA_LAUNCHER_36 = ["self", "gridX", "gridY", "gridZ", "stream", "function", "args"]


def _raw_launch(launcher) -> tuple | None:
    """``(C launch function, cooperative grid, PDL)`` of a Triton 3.6 ``CudaLauncher`` that
    needs no scratch, so the direct path skips its Python ``__call__``; None for any other
    launcher (other Triton releases lay the call out differently)."""
    cls = type(launcher)
    if cls.__name__ != "CudaLauncher":
        return None
    try:
        names = list(inspect.signature(cls.__call__).parameters)
    except (TypeError, ValueError):
        return None
    if names != _CUDA_LAUNCHER_36:
        return None
    if (getattr(launcher, "global_scratch_size", 1) != 0
            or getattr(launcher, "profile_scratch_size", 1) != 0):
        return None
    fn = getattr(launcher, "launch", None)
    if not callable(fn):
        return None
    return fn, launcher.launch_cooperative_grid, launcher.launch_pdl


def _hooks_set() -> bool:
    """Whether Triton's launch hooks are set (its profiler uses them): then launches go
    through ``JITFunction.run``, which calls them."""
    runtime = _knobs_runtime()
    return _is_set(runtime.launch_enter_hook) or _is_set(runtime.launch_exit_hook)


def _is_set(hook) -> bool:
    # newer Tritons keep a chain of hooks that is never None (set when it has calls)
    return hook is not None and bool(getattr(hook, "calls", True))


_RUNTIME: list = []  # Triton's runtime settings object, found on first use


def _knobs_runtime():
    if not _RUNTIME:
        try:
            from triton import knobs
            _RUNTIME.append(knobs.runtime)
        except ImportError:  # a Triton without knobs keeps its hooks elsewhere: never direct
            _RUNTIME.append(_AlwaysHooked())
    return _RUNTIME[0]


class _AlwaysHooked:
    launch_enter_hook = True
    launch_exit_hook = None
