"""Drop-ins for torchtune's (and TRL's) activation offloading, on this package's hooks.

    from torch_pagecomp.integrations.torchtune import get_act_offloading_ctx_manager

    ctx = get_act_offloading_ctx_manager(model, enable_activation_offloading=True)
    with ctx:
        logits = model(tokens)
    loss_fn(logits, labels).backward()

Same names and arguments as ``torchtune.training.OffloadActivations``,
``torchtune.training.NoOpManager`` and ``torchtune.training.get_act_offloading_ctx_manager``
(torchtune 0.6; TRL's ``trl.models.activation_offloading`` copies them, and its trainers call
``get_act_offloading_ctx_manager(model=...)``; ``OffloadActivations.update_model_params`` is
TRL's too), so a recipe swaps the import. Underneath is
:class:`~torch_pagecomp.ActivationOffloader`: saved activations leave the GPU as LZ4 pages
where that pays (``prefer="speed"``: compressed and plain copied steps are timed
and the faster way kept; ``prefer="memory"`` always compresses what compresses), are prefetched
ahead of backward, and gradients are bit-identical to no offload. Neither torchtune nor TRL is
imported.

How torchtune's arguments map here:

* ``min_offload_size`` (bytes, default 1024) -> ``min_offload_bytes``: tensors whose storage is
  smaller stay where they are (torchtune measures the tensor, we its whole storage: views of
  one storage are offloaded once).
* ``max_fwd_stash_size`` (default 5) -> ``max_in_flight_tensors``, the bound of the in-flight stash
  (``max_in_flight_bytes``). In torchtune it is a count: the GPU tensors kept alive while their
  copy to the host runs; past it the compute stream waits for the oldest (a GPU-side wait).
  Here the same count is enforced together with ``max_in_flight_bytes`` (our byte bound,
  default 1 GiB): the compute stream waits for the oldest offload once more than
  ``max_fwd_stash_size`` are unfinished *or* they hold more than ``max_in_flight_bytes``.
  Storages held on the GPU for the backward (the last groups, ``prefetch=1``) count too:
  fewer than ``max_fwd_stash_size`` of them wait at once, the oldest stored first.
  The stash exists on CUDA only; CPU tensors (``offload_cpu=True``) are stored synchronously.
* ``use_streams`` (default True): torchtune copies on a side stream (True) or on the compute
  stream (False). Here offloads always run on side streams (the compressed path needs them);
  ``use_streams`` sets the overlap of restores: True prefetches the previous group(s) of
  activations on a side stream ahead of backward (``prefetch=1``), False restores each tensor
  when backward unpacks it (``prefetch=0``).
* ``use_pin_memory`` (default True): torchtune's host copies are pinned (True) or pageable.
  Here host storage is always page-locked (the kernels write compressed pages straight into a
  pinned arena; plain copies go to a pinned pool, bounded by ``max_pinned_bytes``), so the
  argument is accepted and recorded, and changes nothing.

Any other keyword goes to :class:`~torch_pagecomp.ActivationOffloader` (``mode``, ``prefer``,
``prefetch``, ``offload_cpu``, ``max_in_flight_bytes``, ``group_bytes``, ...).
"""

from __future__ import annotations

import contextlib
import numbers
import warnings
import weakref

from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from .._args import check_int
from ..offload import ActivationOffloader
from ..offload._wrap import KeptRegions, _OnRemove

__all__ = ["NoOpManager", "OffloadActivations", "get_act_offloading_ctx_manager"]


class OffloadActivations(ActivationOffloader):
    """``torchtune.training.OffloadActivations`` on this package's hooks (a context manager).

    Args:
        use_pin_memory: accepted for compatibility; host storage is always pinned here.
        use_streams: True: restores prefetched on a side stream ahead of backward
            (``prefetch=1``); False: each tensor restored when unpacked (``prefetch=0``).
        max_fwd_stash_size: at most this many offloads (>= 1) unfinished on the GPU before the
            compute stream waits for the oldest, storages held for the backward counted;
            ``max_in_flight_bytes`` bounds their bytes too.
        min_offload_size: bytes below which a tensor's storage is not offloaded
            (``min_offload_bytes``).
        settings: any other :class:`~torch_pagecomp.ActivationOffloader` argument (default
            ``prefer="speed"``; ``offload_cpu=True`` also offloads CPU tensors).

    Raises:
        ValueError: if ``max_fwd_stash_size`` is not an int of at least 1 (as torchtune).

    Example (made once, entered every step: its page-locked buffers and ``prefer="speed"``'s
    measurements live in the instance, so one made per step pinned host memory again and
    never got past the tuner's warm-up)::

        offload = OffloadActivations()
        for inputs in batches:
            with offload:
                logits = model(inputs)
            loss = ...
            loss.backward()
    """

    def __init__(
        self,
        use_pin_memory: bool = True,
        use_streams: bool = True,
        max_fwd_stash_size: int = 5,
        min_offload_size: int = 1024,
        **settings,
    ) -> None:
        if isinstance(max_fwd_stash_size, bool) or not isinstance(
                max_fwd_stash_size, numbers.Integral):
            # (a numpy int is one; 2.0 was refused as if it were below 1)
            raise ValueError(
                f"max_fwd_stash_size should be an int (at least 1) but is {max_fwd_stash_size!r}")
        if max_fwd_stash_size < 1:
            raise ValueError(
                f"max_fwd_stash_size should be at least 1 but is {max_fwd_stash_size!r}"
            )
        for ours, theirs in (("min_offload_bytes", "min_offload_size"),
                             ("max_in_flight_tensors", "max_fwd_stash_size")):
            if ours in settings:
                raise TypeError(f"pass {theirs} (torchtune's name), not {ours}")
        check_int("min_offload_size", min_offload_size, 0)  # torchtune's name in the message
        self.use_pin_memory = bool(use_pin_memory)
        self.use_streams = bool(use_streams)
        self.max_fwd_stash_size = max_fwd_stash_size
        self.min_offload_size = min_offload_size
        settings.setdefault("prefer", "speed")
        settings.setdefault("prefetch", 1 if use_streams else 0)
        super().__init__(min_offload_bytes=min_offload_size,
                         max_in_flight_tensors=max_fwd_stash_size, **settings)
        # the head's keep_on_gpu regions (its hooks, ``get_act_offloading_ctx_manager``):
        # any left open by an interrupted forward are closed at each pass's start and end
        self._head_regions = KeptRegions()

    def __enter__(self) -> OffloadActivations:
        if self._depth == 0:  # (a pass starts outside the head's forward)
            self._head_regions.close_left_open()
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        try:
            super().__exit__(*exc)
        finally:
            if self._depth == 0:
                self._head_regions.close_left_open()

    def update_model_params(self, model: nn.Module) -> None:
        """TRL's name for :meth:`keep_tensors_of`: ``model``'s parameters and buffers (and views
        of them) are never offloaded."""
        self.keep_tensors_of(model)


class NoOpManager(saved_tensors_hooks):
    """``torchtune.training.NoOpManager``: saved-tensor hooks that pass tensors through, so the
    hooks entered before (any offloader's) do not see what is saved inside. With this
    package's offloaders :func:`torch_pagecomp.keep_on_gpu` does the same and is counted in
    their stats (``kept_region``)."""

    def __init__(self) -> None:
        def noop(tensor):
            return tensor

        super().__init__(noop, noop)


def _output_head(model: nn.Module) -> nn.Module | None:
    """The module computing the logits: torchtune's ``model.output`` (or a ``TiedLinear``'s
    ``.linear``), an encoder-decoder's ``model.decoder.output``, or Hugging Face's
    ``get_output_embeddings()`` / ``lm_head`` (TRL), looked for in ``model`` and, as TRL
    does, in what it wraps: ``model.module`` (DDP, accelerate) and a PEFT model's
    ``base_model``."""
    for m in _unwrapped(model):
        head = _own_head(m)
        if head is not None:
            return head
    return None


def _unwrapped(model: nn.Module) -> list[nn.Module]:
    """``model``, then the modules it wraps that TRL looks into for the head."""
    out = [model]
    inner = getattr(model, "module", None)
    if isinstance(inner, nn.Module):
        out.append(inner)
    last = out[-1]
    base = getattr(last, "base_model", None)
    if hasattr(last, "peft_config") and isinstance(base, nn.Module) and base is not last:
        out.append(base)
    return out


def _own_head(model: nn.Module) -> nn.Module | None:
    candidates = []
    if hasattr(model, "output"):
        candidates.append(model.output)
    decoder = getattr(model, "decoder", None)
    if isinstance(decoder, nn.Module) and hasattr(decoder, "output"):
        candidates.append(decoder.output)
    get = getattr(model, "get_output_embeddings", None)
    if callable(get):
        try:
            candidates.append(get())
        except (NotImplementedError, AttributeError):
            pass
    candidates.append(getattr(model, "lm_head", None))
    for c in candidates:
        if isinstance(c, nn.Module):
            return c
        linear = getattr(c, "linear", None)  # torchtune's TiedLinear is not a Module
        if isinstance(linear, nn.Module):
            return linear
    return None


def get_act_offloading_ctx_manager(
    model: nn.Module,
    enable_activation_offloading: bool = True,
    *,
    use_pin_memory: bool = True,
    use_streams: bool = True,
    min_offload_size: int = 1024,
    max_fwd_stash_size: int = 5,
    warn_if_no_head: bool = True,
    **settings,
) -> OffloadActivations | contextlib.nullcontext:
    """``torchtune.training.get_act_offloading_ctx_manager``: an :class:`OffloadActivations`
    for ``model`` whose output head keeps its activations on the GPU (offloading the logits'
    inputs only to bring them back at once costs more than it saves), or a
    ``contextlib.nullcontext()`` when ``enable_activation_offloading`` is False.

    The head is ``model.output`` (a ``TiedLinear``'s ``.linear``), ``model.decoder.output``,
    ``model.get_output_embeddings()`` or ``model.lm_head``, also inside ``model.module``
    (DDP, accelerate) and a PEFT model's ``base_model``, as TRL looks; torchtune wraps it in a
    ``NoOpManager``, here its forward runs under :func:`torch_pagecomp.keep_on_gpu`. In
    addition, every block of an ``nn.ModuleList`` in ``model`` starts a prefetch group at its
    forward, and ``model``'s parameters and buffers are never offloaded (as with
    :func:`torch_pagecomp.offload_module`). ``ctx.remove()`` takes these hooks off, and closes
    the head's region a forward interrupted on the calling thread left open (as does
    collecting ``ctx``: the model does not keep it alive).

    The keyword arguments after ``enable_activation_offloading`` are TRL's
    (``trl.models.activation_offloading``) and any :class:`~torch_pagecomp.ActivationOffloader`
    setting.
    """
    if not enable_activation_offloading:
        return contextlib.nullcontext()
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    ctx = OffloadActivations(
        use_pin_memory=use_pin_memory,
        use_streams=use_streams,
        max_fwd_stash_size=max_fwd_stash_size,
        min_offload_size=min_offload_size,
        **settings,
    )
    ctx.keep_tensors_of(model)
    head = _output_head(model)
    if head is not None:
        ctx._head_regions.add(head, ctx._handles)
    elif warn_if_no_head:
        warnings.warn(
            "During activation offloading, no output head was detected. If your model has an "
            "output head, it will be offloaded. This usually greatly slows training, given the "
            "large vocabulary size. To change this behavior, set your output head as "
            "model.output (or model.lm_head) and make it an nn.Module.",
            stacklevel=2,
        )
    # the blocks' hooks reach the offloader through a weak reference: held by the model, they
    # would keep every ctx made for it (and its pinned pools and stores) alive as long as the
    # model, each adding its hooks (a recipe making one per step, a second TRL trainer)
    ref = weakref.ref(ctx)

    def start_group(mod, args):
        off = ref()
        if off is not None:
            off.next_group()

    for block in (b for m in model.modules() if isinstance(m, nn.ModuleList) for b in m):
        if block is not head:
            ctx._handles.append(block.register_forward_pre_hook(start_group))
    # last: when the hooks come off (``remove()``, or the collection below), a head region an
    # interrupted forward outside the ctx left open on this thread is closed. Left open, no
    # later pass of this ctx would close it, and every tensor any offloader saw on the thread
    # stayed in place for good (a recipe's next ctx has regions of its own)
    ctx._handles.append(_OnRemove(ctx._head_regions.close_left_open))
    # a ctx dropped without remove() takes its hooks off the model when it is collected
    weakref.finalize(ctx, _remove_handles, ctx._handles).atexit = False
    return ctx


def _remove_handles(handles: list) -> None:
    for h in handles:
        h.remove()
    handles.clear()

