"""``offload_module``: the activation offload hooks on a model, with a prefetch group per block
and blocks whose activations stay on the GPU."""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Iterable

import torch

from ._entry import _in_backward, _tls
from ._hooks import ActivationOffloader


def offload_module(
    module: torch.nn.Module,
    blocks: Iterable[torch.nn.Module] | None = None,
    keep: Iterable[torch.nn.Module] = (),
    offloader: ActivationOffloader | None = None,
    **settings,
) -> ActivationOffloader:
    """Offload the activations of every forward of ``module``; returns the offloader.

    ``module``'s parameters and buffers stay on the GPU. Each module of ``blocks`` (default:
    the children of every ``nn.ModuleList`` inside ``module``) starts a prefetch group at its
    forward. Tensors saved inside the forwards of ``keep`` (e.g. the last blocks, whose
    activations backward needs first) stay on the GPU. ``offloader.remove()`` takes the
    hooks off, and ends the pass and ``keep`` regions a forward interrupted on the calling
    thread left open (see :class:`KeptRegions`). A forward that starts without grad
    (``torch.no_grad``, ``torch.inference_mode``: evaluation, generation) enters no pass: it
    saves nothing for a backward (what an ``enable_grad`` region inside it saves stays on the
    GPU).

    Raises:
        ValueError: ``module`` is not a module that is called: a container without a forward
            (``nn.ModuleList``, ``nn.ModuleDict``) never runs its hooks, so nothing would be
            offloaded; pass the module that calls it (its children are the default blocks).
    """
    if not isinstance(module, torch.nn.Module):
        raise ValueError(f"offload_module takes a torch.nn.Module, got {type(module).__name__}")
    if getattr(module.forward, "__func__", None) is torch.nn.Module.forward:
        # its hooks would never run: every forward offloaded nothing, without a word
        raise ValueError(
            f"offload_module takes the module that is called; {type(module).__name__} has no "
            "forward (pass the model that calls it: its ModuleLists' children are the blocks)")
    if offloader is not None:
        if not isinstance(offloader, ActivationOffloader):
            raise ValueError(
                f"offloader must be an ActivationOffloader, got {type(offloader).__name__}")
        if settings:  # they would be dropped: the offloader given has its own
            raise ValueError(f"settings {sorted(settings)} go to the ActivationOffloader "
                             "given as offloader, not here")
    if blocks is None:
        blocks = [
            b for m in module.modules() if isinstance(m, torch.nn.ModuleList) for b in m
        ]
    blocks, keep = _modules("blocks", blocks), _modules("keep", keep)
    off = offloader if offloader is not None else ActivationOffloader(**settings)
    off.keep_tensors_of(module)

    # this thread's forwards of ``module`` under way, innermost last: whether each entered the
    # offloader (torch keeps saved-tensor hooks per thread)
    local = threading.local()
    kept = KeptRegions()
    # weakly: ``off._handles`` holds this function (``_OnRemove``), and a strong reference
    # made a cycle that kept the offloader (pinned pools, GPU scratch) alive after its model
    # and the caller dropped it, until the cyclic collector ran
    off_ref = weakref.ref(off)

    def calls() -> list[bool]:
        return local.__dict__.setdefault("calls", [])

    def close_left_open():
        """End this thread's passes that forwards of ``module`` entered and never left, and
        close the ``keep`` regions they left open: called where none is under way."""
        open_calls = calls()
        try:
            while open_calls:
                # taken off before the exit: one that raises (a store, a warning made an
                # error) is not exited again by the next call (the depth below zero)
                entered, live = open_calls.pop(), off_ref()
                if entered and live is not None:
                    live.__exit__(None, None, None)
        finally:
            kept.close_left_open()

    def enter(mod, args):
        open_calls = calls()
        inside_backward = _in_backward()  # (a checkpoint's recompute: enters no pass)
        if not inside_backward and open_calls and _forwards_of(mod) == 1:
            # this thread's last forward of ``mod`` never reached its forward hook
            # (interrupted: see :class:`KeptRegions`): a pass it entered would never end
            # again (its held storages never stored, its groups growing every step), and a
            # ``keep`` region it left open would keep every later saved tensor in place
            close_left_open()
        # every call is an open call, pushed before the entry (its ``leave`` takes off its
        # own, not its caller's: a forward inside a backward, one whose entry raised). It
        # enters a pass only with grad: a forward without (``torch.no_grad``,
        # ``inference_mode``: evaluation, ``generate()``'s every token) saves nothing for a
        # backward, yet paid the pass's set-up (the kept parameters walked, a store of what a
        # training forward before it still held)
        open_calls.append(False)
        if torch.is_grad_enabled() and not inside_backward:
            off.__enter__()
            open_calls[-1] = True

    def leave(mod, args, out):
        open_calls = calls()
        if open_calls and open_calls.pop():
            off.__exit__(None, None, None)

    off._handles.append(module.register_forward_pre_hook(enter))
    off._handles.append(module.register_forward_hook(leave, always_call=True))
    for b in blocks:
        off._handles.append(b.register_forward_pre_hook(lambda m, a: off.next_group()))
    for k in keep:
        kept.add(k, off._handles)
    # last, once the hooks are off: ``remove()`` after an interrupted forward left the pass
    # entered, its saved-tensor hooks on the thread (every later saved tensor went on into it,
    # and torch's hook stack kept the offloader alive for good) and its ``keep`` regions open
    off._handles.append(_OnRemove(close_left_open))
    return off


class _OnRemove:
    """A handle in ``ActivationOffloader._handles`` whose ``remove()`` (at ``remove()``, or
    the collection of a torchtune ctx) calls ``fn``: there, no forward of the hooked modules
    is under way, so what is still open on the calling thread was left by an interrupt."""

    def __init__(self, fn):
        self._fn = fn

    def remove(self) -> None:
        self._fn()


class KeptRegions:
    """Forward hooks that keep the tensors saved inside modules' forwards where they are (a
    :func:`keep_on_gpu` region per forward), counted per thread and module, so that a region
    a forward left open can be closed. torch runs ``always_call`` forward hooks after an
    ``Exception`` only: a ``KeyboardInterrupt`` (Ctrl-C in a notebook) inside such a forward
    skipped the hook that closes its region, and every later tensor saved on that thread
    stayed on the GPU. The next forward of the module closes it (told from a nested call by
    its frames, :func:`_forwards_of`), as does :meth:`close_left_open`."""

    def __init__(self):
        self._local = threading.local()

    def __deepcopy__(self, memo) -> KeptRegions:
        # a model deep-copied with its hooks (``AveragedModel``, an EMA or reference copy)
        # copies their bound methods' ``self``: a ``threading.local`` cannot be copied, so the
        # copy raised. Shared, as the copy shares every other hook's closure (counts are per
        # module, so the copy's forwards keep their own)
        return self

    def _open(self) -> dict[int, int]:
        return self._local.__dict__.setdefault("open", {})

    def add(self, module: torch.nn.Module, handles: list) -> None:
        """Keep what ``module``'s forwards save; the hooks' handles go to ``handles``."""
        handles.append(module.register_forward_pre_hook(self._enter))
        handles.append(module.register_forward_hook(self._leave, always_call=True))

    def _enter(self, mod, args) -> None:
        regions = self._open()
        if regions.get(id(mod)) and _forwards_of(mod) == 1:  # left open by an interrupt
            _tls.keep -= regions.pop(id(mod))
        _tls.keep += 1
        regions[id(mod)] = regions.get(id(mod), 0) + 1

    def _leave(self, mod, args, out) -> None:
        regions = self._open()
        if regions.get(id(mod)):
            regions[id(mod)] -= 1
            _tls.keep -= 1

    def close_left_open(self) -> None:
        """Close the regions still open on this thread: called where no forward of the
        modules is under way (a pass's start or end), so each was left by an interrupt."""
        regions = self._open()
        _tls.keep -= sum(regions.values())
        regions.clear()


_CALL_IMPL = torch.nn.Module._call_impl.__code__


def _forwards_of(mod: torch.nn.Module) -> int:
    """The calls of ``mod`` under way on this thread: its ``nn.Module._call_impl`` frames on
    the stack (a forward pre-hook runs inside its own call's). Walked only where a count says
    a forward of ``mod`` is already open."""
    n, frame = 0, sys._getframe(1)
    while frame is not None:
        if frame.f_code is _CALL_IMPL and frame.f_locals.get("self") is mod:
            n += 1
        frame = frame.f_back
    return n


def _modules(name: str, mods) -> list[torch.nn.Module]:
    """``mods`` (an iterable of modules: a list, a ``ModuleList`` or ``Sequential``, not one
    module) as a list; else ``ValueError`` naming ``name``."""
    if not isinstance(mods, Iterable) or (
            isinstance(mods, torch.nn.Module)
            and not isinstance(mods, (torch.nn.ModuleList, torch.nn.Sequential))):
        raise ValueError(f"{name} must be an iterable of torch.nn.Modules (a list), got "
                         f"{type(mods).__name__}")
    mods = list(mods)
    bad = [m for m in mods if not isinstance(m, torch.nn.Module)]
    if bad:
        raise ValueError(f"{name} must hold torch.nn.Modules, got {type(bad[0]).__name__}")
    return mods
