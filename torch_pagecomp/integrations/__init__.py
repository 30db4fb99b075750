"""Integrations with other libraries; each one is imported only when asked for.

* :mod:`torch_pagecomp.integrations.transformers`: ``CompressedOffloadedCache``, a Hugging Face
  ``transformers`` KV cache whose idle layers live compressed in host memory (needs
  ``transformers``; ``pip install torch-pagecomp[transformers]``).
* :mod:`torch_pagecomp.integrations.torchtune`: ``OffloadActivations`` and
  ``get_act_offloading_ctx_manager``, drop-ins for torchtune's (and TRL's) activation offloading
  that run on this package's hooks (needs neither torchtune nor TRL).

Importing ``torch_pagecomp`` or this package imports neither ``transformers`` nor ``torchtune``:
the names below resolve on first use (``from torch_pagecomp.integrations import
CompressedOffloadedCache`` imports ``transformers`` then).
"""

from __future__ import annotations

import importlib

_LAZY = {
    "CompressedOffloadedCache": "transformers",
    "CompressedLayer": "transformers",
    "OffloadActivations": "torchtune",
    "NoOpManager": "torchtune",
    "get_act_offloading_ctx_manager": "torchtune",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    sub = _LAZY.get(name)
    if sub is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{sub}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
