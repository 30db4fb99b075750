"""``offload_module``: the activation offload hooks on a model, with a prefetch group per block
and blocks whose activations stay on the GPU."""

from __future__ import annotations

import sys
import threading
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
    hooks off.
    """
    if not isinstance(module, torch.nn.Module):
        raise ValueError(f"offload_module takes a torch.nn.Module, got {type(module).__name__}")
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

    # per thread: the forwards of ``module`` that entered the offloader, and the ``keep``
    # regions open, by module (torch keeps saved-tensor hooks per thread)
    local = threading.local()

    def counts(name: str) -> dict[int, int]:
        return local.__dict__.setdefault(name, {})

    def enter(mod, args):
        if _in_backward():
            return
        entered = counts("entered")
        if entered.get(id(mod)) and _forwards_of(mod) == 1:
            # this thread's last forward of ``mod`` entered the offloader and never reached
            # its forward hook: torch runs ``always_call`` hooks after an ``Exception`` only,
            # so a ``KeyboardInterrupt`` (Ctrl-C in a notebook) left that pass open, its
            # saved-tensor hooks on and its ``keep`` regions counted: the pass would never
            # end again (its held storages never stored, its groups growing every step) and
            # no tensor saved on this thread would be offloaded after a kept region
            for _ in range(entered.pop(id(mod))):
                off.__exit__(None, None, None)
            _tls.keep -= sum(counts("kept").values())
            counts("kept").clear()
        off.__enter__()
        entered[id(mod)] = entered.get(id(mod), 0) + 1

    def leave(mod, args, out):
        entered = counts("entered")
        if entered.get(id(mod)):
            entered[id(mod)] -= 1
            off.__exit__(None, None, None)

    off._handles.append(module.register_forward_pre_hook(enter))
    off._handles.append(module.register_forward_hook(leave, always_call=True))
    for b in blocks:
        off._handles.append(b.register_forward_pre_hook(lambda m, a: off.next_group()))

    def keep_enter(mod, args):
        kept = counts("kept")
        if kept.get(id(mod)) and _forwards_of(mod) == 1:  # (interrupted: see ``enter``)
            _tls.keep -= kept.pop(id(mod))
        _tls.keep += 1
        kept[id(mod)] = kept.get(id(mod), 0) + 1

    def keep_leave(mod, args, out):
        kept = counts("kept")
        if kept.get(id(mod)):
            kept[id(mod)] -= 1
            _tls.keep -= 1

    for k in keep:
        off._handles.append(k.register_forward_pre_hook(keep_enter))
        off._handles.append(k.register_forward_hook(keep_leave, always_call=True))
    return off


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


_CALL_IMPL = torch.nn.Module._call_impl.__code__


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
