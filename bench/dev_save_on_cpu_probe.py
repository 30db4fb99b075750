"""Why ``torch.autograd.graph.save_on_cpu(pin_memory=True)`` gives NaN gradients on
transformers' T5 encoder (``bench/results/h200_session72``): each variant on a fresh model, two
steps, its gradients checked for inf / NaN.

``save_on_cpu`` restores every saved tensor contiguous (``torch.empty(size)`` then a copy),
where the hooks of this package give back the layout it was saved with. So the probe wraps
torch's own pack and unpack functions and, at each unpack, compares the tensor it restores with
a copy taken at pack time (bit for bit) and its strides with the saved tensor's:

* ``save_on_cpu``: torch's pinned hooks as they are;
* ``save_on_cpu_check``: the same, with the comparison (a GPU copy of every saved tensor);
* ``save_on_cpu_strides``: the same, each restored tensor put back in the strides it was saved
  with (where those are dense): if only this one is finite, the layout is the cause;
* ``save_on_cpu_sync``: the same, the host waiting for the GPU after each pack (a race between
  the copy to the host and a later write would go away);
* ``save_on_cpu_blocking``: the pinned pack with a blocking copy (``copy_`` without
  ``non_blocking``: torch 2.11's own pack, which later releases make asynchronous);
* ``save_on_cpu_keep``: torch's pinned hooks, each saved GPU tensor kept alive until its unpack
  (its memory not reused while its copy to the host may still read it);
* ``save_on_cpu_nopin``, ``none``: controls;
* ``save_on_cpu_nopin_contig``: the unpinned hooks (which keep a dense tensor's strides), each
  restored tensor made contiguous, as the pinned pack makes it: if this one fails too, the
  layout is the cause, whatever the memory.

A process that dies (an illegal memory access) reports nothing after it: run one variant a
process (``--variants``).

Found (``bench/results/h200_session73``, torch 2.11, H200): the layout is the cause, through
the memory-efficient attention backward: ``save_on_cpu_strides`` trains finite, the contiguous
restores give NaN or an illegal memory access pinned or not, and with that kernel off
(``--sdpa-off efficient``) they train finite.

A GPU diagnostic, not a test: ``python -m bench.dev_save_on_cpu_probe --model t5-1024``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib


def _bits(t):
    """``t``'s bytes as ``uint8`` (a contiguous copy where it is not)."""
    import torch

    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _dense(t) -> bool:
    """Whether ``t``'s elements fill its memory once each, in some order of its dimensions (so
    an empty tensor of its sizes and strides can hold a copy of it)."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def hooks(variant: str, report: dict):
    """The saved-tensor hooks of ``variant`` (see the module docstring); ``report`` collects
    counts and a few examples of what differed."""
    import torch

    if variant == "none":
        return contextlib.nullcontext()
    inner = torch.autograd.graph.save_on_cpu(pin_memory="nopin" not in variant)
    pack0, unpack0 = inner.pack_hook, inner.unpack_hook
    if variant == "save_on_cpu_blocking":
        def pack0(t):
            packed = torch.empty(t.size(), dtype=t.dtype, layout=t.layout,
                                 pin_memory=torch.cuda.is_available())
            packed.copy_(t)
            return t.device, packed
    check = variant == "save_on_cpu_check"
    counts = report.setdefault("counts", collections.Counter())
    # each kind of difference by (shape, dtype, strides saved, strides restored): how often
    examples = report.setdefault("examples", collections.defaultdict(collections.Counter))

    def pack(t):
        saved = (tuple(t.shape), t.stride(), t.dtype, t.device, _dense(t))
        copy = t.detach().clone() if check else None
        packed = pack0(t)
        if variant == "save_on_cpu_sync" and t.is_cuda:
            torch.cuda.synchronize(t.device)
        counts["packed"] += 1
        if variant == "save_on_cpu_keep":
            copy = t  # (never compared: held only)
        return packed, saved, copy

    def unpack(p):
        packed, (shape, stride, dtype, device, dense), copy = p
        out = unpack0(packed)
        if variant == "save_on_cpu_nopin_contig":
            out = out.contiguous()
        counts["unpacked"] += 1
        if out.stride() != stride:
            counts["strides_differ"] += 1
            examples["strides"][(shape, str(dtype), stride, out.stride())] += 1
            if variant == "save_on_cpu_strides" and dense:
                restrided = torch.empty_strided(shape, stride, dtype=dtype, device=out.device)
                restrided.copy_(out)
                out = restrided
                counts["restrided"] += 1
        if check and not torch.equal(_bits(out), _bits(copy)):
            counts["values_differ"] += 1
            examples["values"][(shape, str(dtype), stride, out.stride())] += 1
        return out

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def run(model_name: str, variant: str, steps: int, device: str = "cuda") -> list[str]:
    """Lines of ``variant``'s steps on a fresh ``model_name``: loss, parameters whose
    gradients are not finite, the largest gradient, and what the probe saw."""
    import torch

    from bench.stock_models import build

    model, x, _ = build(model_name, device)
    lines = []
    for step in range(steps):
        report: dict = {}
        model.zero_grad(set_to_none=True)
        with hooks(variant, report):
            loss = model(x).float().square().mean()
        loss.backward()
        grads = [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None]
        bad = [n for n, g in grads if not torch.isfinite(g).all()]
        top = max(g.float().abs().max().item() for _, g in grads)
        seen = dict(report.get("counts", {}))
        lines.append(f"{variant} step {step}: loss {loss.item():.5g}; parameters with inf/NaN "
                     f"gradients {len(bad)} of {len(grads)} {bad[:2]}; max|g| {top:.3g}; {seen}")
        for kind, rows in report.get("examples", {}).items():
            for row, n in sorted(rows.items(), key=lambda kv: -kv[1])[:40]:
                lines.append(f"    {kind} differ x{n}: shape, dtype, saved strides, restored "
                             f"strides {row}")
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="t5-1024")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--variants", default="none,save_on_cpu,save_on_cpu_check,"
                        "save_on_cpu_strides,save_on_cpu_sync,save_on_cpu_nopin")
    parser.add_argument("--sdpa-off", default="",
                        help="SDPA backends to turn off first (comma-separated: cudnn, "
                             "efficient, flash): which attention kernel the layout upsets")
    args = parser.parse_args(argv)
    import torch

    for name in filter(None, args.sdpa_off.split(",")):
        getattr(torch.backends.cuda, {"cudnn": "enable_cudnn_sdp", "efficient":
                                      "enable_mem_efficient_sdp", "flash":
                                      "enable_flash_sdp"}[name])(False)

    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, model {args.model}; "
          f"SDPA backends: flash {torch.backends.cuda.flash_sdp_enabled()}, mem-efficient "
          f"{torch.backends.cuda.mem_efficient_sdp_enabled()}, cuDNN "
          f"{torch.backends.cuda.cudnn_sdp_enabled()}", flush=True)
    for variant in args.variants.split(","):
        for line in run(args.model, variant, args.steps):
            print(line, flush=True)


if __name__ == "__main__":
    main()
