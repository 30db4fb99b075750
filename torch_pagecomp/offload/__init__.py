"""Activation offload: saved-tensor hooks that move activations to host memory during forward
(compressed where it pays) and bring them back ahead of backward.

Public surface: :class:`ActivationOffloader` (``offload_activations(**settings)`` makes one),
:func:`offload_module` (the hooks on a model, a prefetch group per block), :func:`keep_on_gpu`
(a region whose saved tensors stay) and :class:`StepTuner` (``prefer="speed"``'s timing of
compressed against copied steps). The modules behind them are private:

* ``_hooks``: the offloader (pack, stash, policy, stats); ``_batch``: saved storages held
  on the GPU (the backward's first groups, and stores the link cannot take yet) and small ones
  stored together; ``_backward``: unpack, prefetch and the end of backward; ``_entry``:
  passes, groups and entries;
* ``_stores``: pinned copies, CPU stores, the per-class ratio policy; ``_paged``: compressed
  pages placed in a device-side arena of pinned host chunks;
* ``_tune``: the step tuner; ``_wrap``: ``offload_module``.
"""

from ._entry import keep_on_gpu
from ._hooks import ActivationOffloader, offload_activations
from ._tune import StepTuner
from ._wrap import offload_module

__all__ = ["ActivationOffloader", "StepTuner", "keep_on_gpu", "offload_activations",
           "offload_module"]
