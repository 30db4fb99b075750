"""A minimal reproduction, without transformers, of what failed on T5 under torch's
``save_on_cpu(pin_memory=True)`` (``bench/results/h200_session73``): attention through
``F.scaled_dot_product_attention`` with a learned bias as ``attn_mask``, query / key / value
saved as transposed views and the bias expanded over the batch, as T5 saves them, and a
saved-tensor hook that gives every saved tensor back contiguous (what the pinned pack does).
Its gradients against the same step without hooks, for each SDPA backend that takes it.

One process a backend (a fault ends it): ``python -m bench.dev_sdpa_layout_repro --backend
efficient`` (or ``math``, ``cudnn``; ``--steps``, ``--batch``, ``--seq``, ``--heads``,
``--dtype``). For an upstream report: torch's version, the card, the backend and the lines
printed. On one H200 (torch 2.11, ``bench/results/h200_session74/layout_call1.txt``) it does
not fail as T5 did: the efficient backend's contiguous restores train finite, their gradients
2.7e-6 from those without hooks (the math backend's equal); so what T5 adds (its bias's
position buckets, 24 layers, the memory-efficient backward's other inputs) is still part of
the failure.
"""

from __future__ import annotations

import argparse


def step(x, w_qkv, bias, heads: int, contiguous: bool):
    """One attention forward and backward: ``x`` ``[B, L, D]``, ``w_qkv`` ``[3D, D]``, ``bias``
    ``[1, H, L, L]`` (a parameter, expanded over the batch); with ``contiguous``, every saved
    tensor is given back contiguous. Returns the gradients of ``w_qkv`` and ``bias``."""
    import torch
    import torch.nn.functional as F

    b, length, d = x.shape
    w_qkv.grad = bias.grad = None
    hooks = (torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t.contiguous())
             if contiguous else torch.autograd.graph.saved_tensors_hooks(lambda t: t,
                                                                         lambda t: t))
    with hooks:
        qkv = (x @ w_qkv.t()).view(b, length, 3, heads, d // heads)
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # [B, H, L, d] views
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.expand(b, -1, -1, -1))
        loss = out.float().square().mean()
    loss.backward()
    return w_qkv.grad.clone(), bias.grad.clone()


def run(backend: str, steps: int, batch: int, seq: int, heads: int, dtype: str,
        device: str = "cuda") -> list[str]:
    """Lines: per step, whether the contiguous restores' gradients are finite and equal to
    those without hooks."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kind = {"efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]
    dt = getattr(torch, dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    d = 64 * heads
    x = torch.randn(batch, seq, d, device=device, dtype=dt, generator=gen)
    w_qkv = (torch.randn(3 * d, d, device=device, dtype=dt, generator=gen) / d**0.5
             ).requires_grad_()
    bias = (torch.randn(1, heads, seq, seq, device=device, dtype=dt, generator=gen) * 0.1
            ).requires_grad_()
    lines = []
    with sdpa_kernel([kind]):
        for i in range(steps):
            try:
                ref = step(x, w_qkv, bias, heads, contiguous=False)
            except RuntimeError as exc:  # a backend that does not take these inputs (torch
                # 2.11's cuDNN attention and an arbitrary bias on an H200: "No available kernel")
                if "No available kernel" not in str(exc):
                    raise
                return [f"{backend}: takes none of these inputs ({str(exc).splitlines()[0]})"]
            got = step(x, w_qkv, bias, heads, contiguous=True)
            finite = all(bool(torch.isfinite(g).all()) for g in got)
            same = all(torch.equal(a, b) for a, b in zip(ref, got))
            worst = max(float((a.float() - b.float()).abs().max()) for a, b in zip(ref, got))
            lines.append(f"{backend} step {i}: contiguous restores' gradients finite {finite}, "
                         f"equal to no hooks' {same} (largest difference {worst:.3g})")
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="efficient",
                    choices=["efficient", "math", "cudnn", "flash"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    a = ap.parse_args(argv)
    import torch

    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    for line in run(a.backend, a.steps, a.batch, a.seq, a.heads, a.dtype):
        print(line, flush=True)


if __name__ == "__main__":
    main()
