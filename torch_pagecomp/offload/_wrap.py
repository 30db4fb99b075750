"""``offload_module``: the activation offload hooks on a model, with a prefetch group per block
and blocks whose activations stay on the GPU."""

from __future__ import annotations

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

    def enter(mod, args):
        if not _in_backward():
            off.__enter__()
            mod._pagecomp_entered = getattr(mod, "_pagecomp_entered", 0) + 1

    def leave(mod, args, out):
        if getattr(mod, "_pagecomp_entered", 0):
            mod._pagecomp_entered -= 1
            off.__exit__(None, None, None)

    off._handles.append(module.register_forward_pre_hook(enter))
    off._handles.append(module.register_forward_hook(leave, always_call=True))
    for b in blocks:
        off._handles.append(b.register_forward_pre_hook(lambda m, a: off.next_group()))

    def keep_enter(mod, args):
        _tls.keep += 1
        mod._pagecomp_kept = getattr(mod, "_pagecomp_kept", 0) + 1

    def keep_leave(mod, args, out):
        if getattr(mod, "_pagecomp_kept", 0):
            mod._pagecomp_kept -= 1
            _tls.keep -= 1

    for k in keep:
        off._handles.append(k.register_forward_pre_hook(keep_enter))
        off._handles.append(k.register_forward_hook(keep_leave, always_call=True))
    return off


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
