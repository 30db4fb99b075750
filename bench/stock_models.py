"""Activation offload on models this repository does not shape: the judge of the hooks.

Models, built from stock PyTorch modules or public definitions written from torch primitives:

* ``encoder-*``: ``torch.nn.TransformerEncoder`` (``norm_first=True``, GELU, no dropout,
  default SDPA), bf16.
* ``llama-*``: a Llama-style decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention).
* ``resnet-*``: a ResNet-style convolutional network (bottleneck blocks, BatchNorm, ReLU).
* ``gpt2-*``, ``bert-*``, ``hf-llama-*``, ``t5-*``, ``tv-*``: public definitions used as their
  libraries ship them (``transformers``' GPT-2, BERT, Llama and T5's encoder, torchvision's
  ResNet-50, ViT-B/16, ConvNeXt-T and Swin-T: ``bench.public_models``).

Variants: ``none``; ``save_on_cpu`` (``torch.autograd.graph.save_on_cpu(pin_memory=True)``);
``uncompressed``, ``memory``, ``speed`` (``offload_module`` with ``mode="uncompressed"``,
``prefer="memory"``, ``prefer="speed"``; the probe ``speed_copy_only``, ``speed`` copying from
its first pass: ``PROBE_VARIANTS``). ``--codec`` picks the hooks' page codec
(``ActivationOffloader(codec=...)``: ``auto``, the default, stores bf16 / fp16 activations with
the exponent codec and the rest with LZ4; ``lz4``: LZ4 for all); ``--codec auto,lz4`` runs each
compressing variant (``memory``, ``speed``, ``torchtune``) once per codec, for an A/B in one
run; each row records its ``codec`` (None for the variants that never compress). Each (model,
variant) runs in a child process (a fresh CUDA context: clean peaks): warm-up steps, then timed
steps of forward + backward + SGD.
One row per run: step time (median of per-step CUDA-event times), peak GPU memory
(``max_memory_allocated``, and in the JSON where it falls: ``phase_gib``, per timed step the
forward's peak, what the forward leaves allocated, the backward's peak, the backward's and the
optimizer's), host memory at peak (``host_gib``: the hooks' ledger of bytes stored, a storage
counted at full size until its placement is read; ``stored_gib``: the compressed stores' most
bytes stored at once, at their placed sizes, exact from the commit after 055904c, which left
out slices placed but not yet confirmed; ``host_held_gib``: the page-locked memory held, copy
pool and compressed arena), bytes offloaded per step, ratio (uncompressed's ledger over this
row's bytes stored: ``stored_gib`` where every storage was compressed, else the ledger,
which overstates a compressed row's bytes by the storages whose placement the host had not read
at the peak: 1.26 against 1.42 stored on encoder-2048 at b439c64), and whether the gradients
of the first step are bit-identical to ``none`` (deterministic settings: math SDPA,
``torch.use_deterministic_algorithms``; since session 49 that step runs on an offloader of
the variant's settings of its own, closed after, and the timed steps on a fresh one).

    python -m bench.stock_models --models encoder-1024,llama-2048 --out bench/out/stock.json
    python -m bench.stock_models --rounds 3 --variants none,uncompressed,speed ...   # spread
    python -m bench.stock_models --fsdp --nproc 2 --models encoder-1024 ...   # a torchrun each
    torchrun --nproc_per_node 2 -m bench.stock_models --fsdp ...   # every variant in one group

On the CPU (CI) ``--tiny`` runs every model and variant at toy sizes, FSDP2 on gloo.
``STOCK_STREAM_PRIORITY=-5`` (a probe) passes ``stream_priority`` to the hooks.
``STOCK_HOLD_GROUPS=N`` (a probe) sets the groups the hooks hold for the backward (the package's
``prefetch + 1``; 0: none, 1: the current group); each row records ``hold_groups``.
``STOCK_WAIT=1`` (a probe) makes a due compressed store wait for the link, as before 7683f39,
instead of staying held (``_batch.Batcher._starts_now``); each row records ``due_stores_wait``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import os
import statistics
import subprocess
import sys
import time

from bench.children import cell, md_table, run_child, write_results

VARIANTS = ("none", "save_on_cpu", "uncompressed", "memory", "speed", "torchtune")
# probe, run only when asked: ``speed``'s code path copying from its first pass, never
# compressing (:class:`CopyOnlyTuner`). Settled on copying, ``speed`` held
# more GPU memory than ``uncompressed`` in most one-GPU runs on encoder-1024, with the same
# code; this row, peaking from uncompressed's level to 0.36 GiB above it step by step, showed
# the trials leave nothing behind (bench/results/h200_5b2a6fe_session30)
PROBE_VARIANTS = ("speed_copy_only",)
CODECS = ("auto", "lz4")  # the hooks' codec= values (--codec)
LINK_BOUND_X = 1.5  # #21: a step is link-bound where a plain copy takes this x no offload
COMPRESSING = ("memory", "speed", "torchtune")  # the variants whose pages a codec writes
GIB = 1 << 30

# name: (family, width, layers, batch, seq or image size)
MODELS = {
    "encoder-1024": ("encoder", 1024, 8, 8, 1024),
    "encoder-2048": ("encoder", 2048, 8, 4, 2048),
    "llama-2048": ("llama", 2048, 8, 4, 2048),
    "resnet-64": ("resnet", 64, 3, 64, 224),
    # public definitions (bench.public_models): transformers' GPT-2 small and BERT-large
    # geometry, a TinyLlama-shaped LlamaModel, torchvision's ResNet-50 and ViT-B/16
    "gpt2-768": ("hf-gpt2", 768, 12, 8, 1024),
    "bert-1024": ("hf-bert", 1024, 24, 8, 512),
    "hf-llama-2048": ("hf-llama", 2048, 8, 4, 2048),
    "tv-resnet50": ("tv-resnet", 0, 0, 64, 224),
    "tv-vit-b16": ("tv-vit", 0, 0, 64, 224),
    # added in session 69, never tuned on: T5 v1.1-large's encoder geometry, torchvision's
    # ConvNeXt-T and Swin-T
    "t5-1024": ("hf-t5", 1024, 24, 8, 512),
    "tv-convnext-t": ("tv-convnext", 0, 0, 64, 224),
    "tv-swin-t": ("tv-swin", 0, 0, 64, 224),
    # added in session 90, never tuned on: Qwen2-1.5B's geometry at 8 layers, a Mixtral-style
    # mixture of experts, torchvision's EfficientNet-B0 and DenseNet-121
    "qwen2-1536": ("hf-qwen2", 1536, 8, 4, 2048),
    "mixtral-1024": ("hf-mixtral", 1024, 8, 8, 1024),
    "tv-efficientnet-b0": ("tv-efficientnet", 0, 0, 64, 224),
    "tv-densenet121": ("tv-densenet", 0, 0, 64, 224),
    # added in session 91, second sizes of families never tuned on: Qwen2-0.5B's width at 12
    # layers, a wider Mixtral-style model, T5 v1.1-base's encoder width, EfficientNet-B0 at
    # twice the batch
    "qwen2-896": ("hf-qwen2", 896, 12, 4, 2048),
    "mixtral-2048": ("hf-mixtral", 2048, 6, 4, 2048),
    "t5-768": ("hf-t5", 768, 12, 16, 512),
    "tv-efficientnet-b0-128": ("tv-efficientnet", 0, 0, 128, 224),
    # (four blocks: the hooks hold the last two groups, a block each, for the backward)
    "encoder-tiny": ("encoder", 64, 4, 2, 32),
    "llama-tiny": ("llama", 64, 4, 2, 32),
    "resnet-tiny": ("resnet", 8, 1, 2, 32),
    "gpt2-tiny": ("hf-gpt2", 64, 4, 2, 32),
    "bert-tiny": ("hf-bert", 64, 4, 2, 32),
    "hf-llama-tiny": ("hf-llama", 128, 4, 2, 32),
    "t5-tiny": ("hf-t5", 64, 4, 2, 32),
    "qwen2-tiny": ("hf-qwen2", 128, 4, 2, 32),
    "mixtral-tiny": ("hf-mixtral", 128, 4, 2, 32),
}


# ------------------------------------------------------------------------------- models
def _llama(d: int, layers: int):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    heads, kv_heads = max(1, d // 128), max(1, d // 512)
    hd, ffn = d // heads, int(8 * d / 3) // 64 * 64 or 4 * d

    class RMSNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(d))

        def forward(self, x):
            x32 = x.float()
            return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) \
                * self.weight

    def rope(x, pos):  # x: [b, h, s, hd]
        inv = 1.0 / (10000 ** (torch.arange(0, hd, 2, device=x.device).float() / hd))
        ang = pos[:, None].float() * inv[None]
        cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
        x1, x2 = x[..., ::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).flatten(-2)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.n1, self.n2 = RMSNorm(), RMSNorm()
            self.q = nn.Linear(d, heads * hd, bias=False)
            self.kv = nn.Linear(d, 2 * kv_heads * hd, bias=False)
            self.o = nn.Linear(heads * hd, d, bias=False)
            self.gate_up = nn.Linear(d, 2 * ffn, bias=False)
            self.down = nn.Linear(ffn, d, bias=False)

        def forward(self, x):
            b, s, _ = x.shape
            h = self.n1(x)
            q = self.q(h).view(b, s, heads, hd).transpose(1, 2)
            k, v = self.kv(h).view(b, s, 2, kv_heads, hd).unbind(2)
            pos = torch.arange(s, device=x.device)
            q, k = rope(q, pos), rope(k.transpose(1, 2), pos)
            v = v.transpose(1, 2)
            rep = heads // kv_heads
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.o(a.transpose(1, 2).reshape(b, s, d))
            g, u = self.gate_up(self.n2(x)).chunk(2, -1)
            return x + self.down(F.silu(g) * u)

    class Llama(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Block() for _ in range(layers))
            self.norm = RMSNorm()

        def forward(self, x):
            for blk in self.layers:
                x = blk(x)
            return self.norm(x)

    return Llama()


def _resnet(width: int, stages: int):
    import torch.nn as nn

    class Bottleneck(nn.Module):
        def __init__(self, cin, mid, stride):
            super().__init__()
            cout = 4 * mid
            self.body = nn.Sequential(
                nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU(inplace=True),
                nn.Conv2d(mid, mid, 3, stride, 1, bias=False), nn.BatchNorm2d(mid),
                nn.ReLU(inplace=True), nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout),
            )
            self.skip = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                       nn.BatchNorm2d(cout))
                         if stride != 1 or cin != cout else nn.Identity())
            self.act = nn.ReLU(inplace=True)

        def forward(self, x):
            return self.act(self.body(x) + self.skip(x))

    class ResNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, width, 7, 2, 3, bias=False),
                                      nn.BatchNorm2d(width), nn.ReLU(inplace=True),
                                      nn.MaxPool2d(3, 2, 1))
            blocks, cin = [], width
            for i in range(stages):
                mid = width * 2 ** i
                for j in range(3):
                    blocks.append(Bottleneck(cin, mid, 2 if (j == 0 and i > 0) else 1))
                    cin = 4 * mid
            self.layers = nn.ModuleList(blocks)

        def forward(self, x):
            x = self.stem(x)
            for blk in self.layers:
                x = blk(x)
            return x

    return ResNet()


def model_and_shape(name: str):
    """``(model, input shape)`` of ``name``, the model in fp32 on the current default device
    (``bench.dev_arena_model`` builds them on the meta device)."""
    import torch.nn as nn

    family, width, layers, batch, seq = MODELS[name]
    if family.startswith(("hf-", "tv-")):
        from bench.public_models import build_public

        return build_public(family, width, layers, batch, seq)
    if family == "encoder":
        layer = nn.TransformerEncoderLayer(width, max(1, width // 128), 4 * width, dropout=0.0,
                                           activation="gelu", batch_first=True,
                                           norm_first=True)
        model = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        shape = (batch, seq, width)
    elif family == "llama":
        model = _llama(width, layers)
        shape = (batch, seq, width)
    else:
        model = _resnet(width, layers)
        shape = (batch, 3, seq, seq)
    return model, shape


def build(name: str, device):
    """``(model, input, blocks)`` of ``name`` in bf16 on ``device``, seeded."""
    import torch

    torch.manual_seed(0)
    model, shape = model_and_shape(name)
    model = model.to(device).to(torch.bfloat16)
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(shape, device=device, dtype=torch.bfloat16, generator=gen)
    return model, x, list(model.layers)


# ------------------------------------------------------------------------------- one run
def local_part(t):
    """This rank's part of an FSDP2 shard (a DTensor's local tensor), else ``t``."""
    return t.to_local() if hasattr(t, "to_local") else t


def _grad_hash(model) -> list[int]:
    import torch

    out = []
    for p in model.parameters():
        if p.grad is None:
            continue
        g = p.grad.detach()
        g = local_part(g)
        g = g.reshape(-1).view(torch.int16).to(torch.int64)
        w = torch.arange(1, g.numel() + 1, device=g.device, dtype=torch.int64) % 65521
        out.append(int((g * w).sum()))
    return out


def _profile(train_step, path: str) -> None:
    """One more step under the profiler (where the GPU time goes, by kernel and copy), then
    one under cProfile (the host side, no profiler hooks on every op)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench.dev_host_profile import profile_calls

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        train_step()
        torch.cuda.synchronize()
    with open(path, "w") as fh:
        fh.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
        fh.write("\n\n# cProfile of one step's host side (by own time; cumulative for the "
                 "package's and Triton's functions)\n")
        fh.write(profile_calls(train_step, 1, 30,
                               cumulative="torch_pagecomp|triton_kernels|triton/runtime"))


class CopyOnlyTuner:
    """``prefer="speed"``'s tuner made to copy every pass from the first: the speed variant's
    code path without a compressed pass ever run (variant ``speed_copy_only``, here and in
    ``bench.dev_hook_timing``). Beside ``uncompressed`` and ``speed`` (copying after its
    compressed trials) it tells whether the speed arm's extra host time or GPU memory comes
    from its own code path or from what the trials leave behind (pools, arena, allocator
    state)."""

    checking = False  # nothing to check: the choice never changes

    def __init__(self):
        self.choice = self.arm = "copy"
        self.history: list = []

    def start_pass(self, grew: bool = False) -> str:
        return "copy"

    def add_bytes(self, nbytes: int) -> None:
        pass

    def summary(self) -> dict:
        return {"phase": "forced", "arm": "copy", "choice": "copy"}


def variant_settings(variant: str, device: str) -> dict:
    """The ``ActivationOffloader`` arguments of an offloading variant (``uncompressed``,
    ``memory``, ``speed``, the probe ``speed_copy_only``) on ``device``; on the CPU (CI, toy
    sizes) the hooks' CPU path, for tensors from 4 KiB."""
    kw = {"uncompressed": dict(mode="uncompressed"), "memory": dict(prefer="memory"),
          "speed": dict(prefer="speed"),
          "speed_copy_only": dict(prefer="speed", tuner=CopyOnlyTuner())}[variant]
    if device == "cpu":
        kw.update(offload_cpu=True, min_offload_bytes=1 << 12)
    return kw


def shard(model, blocks: list, device: str) -> None:
    """FSDP2 over the process group: ``fully_shard`` per block, then the whole ``model``, on a
    mesh of ``device``'s type (``fully_shard``'s default mesh takes the machine's
    accelerator, so CPU ranks on gloo failed on a host that has a GPU)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(torch.device(device).type, (dist.get_world_size(),))
    for blk in blocks:
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)


def any_rank(flag: bool, device: str) -> bool:
    """``flag`` on any rank of the process group (each rank's tensor on ``device``): ranks
    that step until every rank's tuner has chosen take the same steps, so their collectives
    stay paired."""
    import torch
    import torch.distributed as dist

    if dist.get_world_size() == 1:
        return flag
    t = torch.tensor([int(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def run_meta(cuda: bool) -> dict:
    """The top of a JSON of rows: ``device``, ``commit``, ``date``, ``torch``, ``command``,
    ``gpus`` (1: a multi-rank run sets its own)."""
    import torch

    return {"device": torch.cuda.get_device_name() if cuda else "cpu",
            "commit": os.environ.get("PAGECOMP_COMMIT", "unknown"),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__, "command": " ".join(sys.argv), "gpus": 1}


def per_step(before: dict, after: dict, steps: int, counters) -> tuple[dict, dict]:
    """Between two ``ActivationOffloader.stats()`` taken ``steps`` timed steps apart: the
    hooks' own host ms per step (``host_s``: pack, unpack), set against the step's host issue
    time, and each of ``counters`` (names) per step."""
    spent = before.get("host_s", {})
    hook_ms = {k: (v - spent.get(k, 0.0)) * 1e3 / steps
               for k, v in after.get("host_s", {}).items()}
    return hook_ms, {k: (after.get(k, 0) - before.get(k, 0)) / steps for k in counters}


def end_process_group(cuda: bool) -> None:
    """Tear the process group down together (no rank leaves while another still talks; on
    NCCL with its device named, else the barrier warns that it guesses it), then join its
    threads (:func:`_join_process_group_threads`)."""
    import torch
    import torch.distributed as dist

    dist.barrier(**({"device_ids": [torch.cuda.current_device()]} if cuda else {}))
    dist.destroy_process_group()
    _join_process_group_threads()


def run(name: str, variant: str, steps: int, warmup: int, device: str, fsdp: bool,
        profile: str | None = None, min_offload_bytes: int | None = None,
        record_phases: bool = True, codec: str = "auto") -> dict:
    import torch

    if codec not in CODECS:
        raise ValueError(f"codec must be one of {CODECS}, got {codec!r}")

    from torch_pagecomp import ActivationOffloader, offload_module

    model, x, blocks = build(name, device)
    if fsdp:
        shard(model, blocks, device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    off = ctx = hooks = None
    if variant == "save_on_cpu":
        from bench.training_bench import CountingSaveOnCpu

        ctx = CountingSaveOnCpu()
    elif variant == "torchtune":  # the drop-in, as a torchtune recipe sets it up
        from torch_pagecomp.integrations.torchtune import get_act_offloading_ctx_manager

        kw = dict(offload_cpu=True, min_offload_size=1 << 12) if device == "cpu" else {}
        off = ctx = get_act_offloading_ctx_manager(model, True, warn_if_no_head=False,
                                                   codec=codec, **kw)
    elif variant != "none":
        kw = {**variant_settings(variant, device), "codec": codec}
        if min_offload_bytes is not None:
            kw["min_offload_bytes"] = min_offload_bytes
        if os.environ.get("STOCK_STREAM_PRIORITY"):  # probe: the hooks' side-stream priority
            kw["stream_priority"] = int(os.environ["STOCK_STREAM_PRIORITY"])
        hooks = kw
        off = offload_module(model, blocks=blocks, **kw)  # the gradient check's (below)
        if os.environ.get("STOCK_HOLD_GROUPS"):  # probe: the groups held for the backward
            from torch_pagecomp.offload._batch import Batcher

            groups = int(os.environ["STOCK_HOLD_GROUPS"])
            Batcher.window = property(lambda self: groups)  # this child's process only
        if os.environ.get("STOCK_WAIT") == "1":  # probe: due stores wait for the link
            from torch_pagecomp.offload._batch import Batcher

            Batcher._starts_now = lambda self, batch: True  # this child's process only

    phases: list[list[float]] = []  # per timed step, GiB: see ``row["phase_gib"]``

    def step(record: bool = False):
        opt.zero_grad(set_to_none=True)
        if record:
            torch.cuda.reset_peak_memory_stats()
        if ctx is not None:
            with ctx:
                y = model(x)
        else:
            y = model(x)
        if record:  # host-side counters only: nothing waits, nothing of the hooks is touched
            phases.append([torch.cuda.max_memory_allocated() / GIB,
                           torch.cuda.memory_allocated() / GIB])
            torch.cuda.reset_peak_memory_stats()
        y.float().square().mean().backward()
        if record:
            phases[-1].append(torch.cuda.max_memory_allocated() / GIB)

    def train_step(record: bool = False):
        step(record)
        opt.step()
        if record:  # the backward's and the optimizer's peak
            phases[-1].append(torch.cuda.max_memory_allocated() / GIB)

    # first step: deterministic settings, gradients hashed for the identity check
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.use_deterministic_algorithms(True, warn_only=True)
    with sdpa_kernel(SDPBackend.MATH):
        step()
        grads = _grad_hash(model)
        if variant == "none":  # is the model itself deterministic here?
            step()
            grads = grads if _grad_hash(model) == grads else None
    torch.use_deterministic_algorithms(False)
    if hooks is not None:  # the timed steps on an offloader that never saw that step: SDPA's
        # math kernel saves the attention matrix too, and the offloader that took it held
        # more host and GPU memory for several steps after
        # (``bench/results/h200x2_91fcaaa_session49``)
        off.remove()
        off.close()
        off = offload_module(model, blocks=blocks, **hooks)
    opt.step()
    cuda = device != "cpu"
    times, issue = [], []
    for _ in range(warmup):
        train_step()
    # prefer="speed" is measured once its tuner has chosen and checked the choice against
    # the steps it gives (its trial passes time both ways and grow both pools once): the
    # warm-up goes on until then, at most 24 steps more
    tuner = off.tuner if off is not None else None

    def undecided() -> bool:
        flag = tuner is not None and (tuner.choice is None or tuner.checking)
        return any_rank(flag, device) if fsdp else flag

    while warmup < 28 and undecided():
        warmup += 1
        train_step()
        if cuda:
            torch.cuda.synchronize()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = {}
    if off is not None:
        off.reset_peak_stats()
        before = off.stats()
    for _ in range(steps):
        t0 = time.perf_counter()
        if cuda:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
        train_step(record=cuda and record_phases)
        if cuda:
            e1.record()
            issue.append((time.perf_counter() - t0) * 1e3)  # the host's issue time
            e1.synchronize()
            times.append(e0.elapsed_time(e1))
        else:
            times.append((time.perf_counter() - t0) * 1e3)
    row = {"model": name, "variant": variant,
           "codec": codec if variant in COMPRESSING else None,
           "hold_groups": (off._batcher.window if isinstance(off, ActivationOffloader)
                           else None),
           "due_stores_wait": os.environ.get("STOCK_WAIT") == "1",
           "step_ms": statistics.median(times),
           "step_ms_all": [round(t, 2) for t in times], "grads": grads,
           "warmup_steps": warmup}
    if cuda:  # the peak over every phase of every timed step (optimizer steps included)
        row["peak_gpu_gib"] = (max(max(p) for p in phases) if phases
                               else torch.cuda.max_memory_allocated() / GIB)
        # where the peak is: per timed step, the forward's peak, what is allocated when the
        # forward ends, the backward's peak, then that of the backward and the optimizer (GiB)
        row["phase_gib"] = [[round(v, 3) for v in p] for p in phases]
        row["host_issue_ms"] = statistics.median(issue)
    st = off.stats() if off is not None else None  # the timed steps' (before any profile)
    if profile and cuda:
        _profile(train_step, profile)
    if off is not None:
        offloaded = (st.get("offloaded_bytes", 0) - before.get("offloaded_bytes", 0)) / steps
        # counters per timed step (what the warm-up did is not in them), other values as read
        row["hook_host_ms"], counts = per_step(before, st, steps, off.counters)
        row.update(host_gib=st["peak_host_bytes"] / GIB, offloaded_gib=offloaded / GIB,
                   stats={**{k: v for k, v in st.items() if not isinstance(v, dict)}, **counts},
                   compressor=st.get("compressor", {}), tuner=st.get("tuner"),
                   policy=st.get("policy"))  # per class: ratio, codec, every candidate's
        comp = [c for c in st.get("compressor", {}).values()]
        row["host_held_gib"] = (st["pinned_held_bytes"]
                                + sum(c["host_peak_held_bytes"] for c in comp)) / GIB
        row["scratch_gib"] = sum(c["scratch_bytes"] for c in comp) / GIB
        # the compressed stores' peak of placed bytes (exact sizes; ``host_gib`` is the hooks'
        # ledger, which counts a storage at full size until its placement is read)
        if comp:
            row["stored_gib"] = sum(c["host_peak_used_bytes"] for c in comp) / GIB
            # the host's waits for packs per timed step (in ``host_issue_ms``, but not work)
            waited = sum(c.get("host_wait_us", 0) for c in comp) - sum(
                c.get("host_wait_us", 0) for c in before.get("compressor", {}).values())
            row["host_wait_ms"] = waited / steps / 1e3
        off.remove()
    elif ctx is not None:
        row.update(host_gib=ctx.bytes / GIB, offloaded_gib=ctx.bytes / GIB)
    return row


# ------------------------------------------------------------------------------ driver
def _row_key(name: str, variant: str, codec: str) -> dict:
    """What names a run's row (all a row holds when the run fails)."""
    return {"model": name, "variant": variant,
            "codec": codec if variant in COMPRESSING else None}


def _run_args(args, codec: str) -> list[str]:
    """The options a run in another process takes from this one's."""
    extra = ([] if args.min_offload_bytes is None
             else ["--min-offload-bytes", str(args.min_offload_bytes)])
    return ["--steps", str(args.steps), "--warmup", str(args.warmup), "--device", args.device,
            "--codec", codec, *extra]


def _child(args, name: str, variant: str, codec: str = "auto") -> dict:
    env = dict(os.environ)
    env.pop("STOCK_PROFILE", None)
    if args.profile and args.profile.split(":")[:2] == [name, variant]:
        env["STOCK_PROFILE"] = args.profile.split(":", 2)[2]
    extra = ["--no-phases"] if args.no_phases else []
    return run_child("bench.stock_models",
                     ["--child", name, variant, *_run_args(args, codec), *extra],
                     _row_key(name, variant, codec), args.timeout, env=env)


def _codecs_of(variant: str, codecs: list[str]) -> list[str]:
    """The codecs ``variant`` runs with: each of ``codecs`` where it compresses, else one run
    (its first: the hooks take the setting, nothing is coded with it)."""
    return codecs if variant in COMPRESSING else codecs[:1]


def _finish(rows: list[dict], meta: dict) -> dict:
    """Ratios, link-boundness and the gradient identity, per model, against ``none`` (a
    variant run more than once, to see the spread, is compared through its last row).
    ``link_bound`` is None where this run has no ``none`` or no ``uncompressed`` row."""
    by = {}
    for r in rows:
        by.setdefault(r["model"], []).append(r)
    for rs in by.values():
        last = {r["variant"]: r for r in rs}
        none, unc = last.get("none", {}), last.get("uncompressed", {})
        # unknown (None) without both rows in this run: not claimed either way
        bound = (unc["step_ms"] >= LINK_BOUND_X * none["step_ms"]
                 if none.get("step_ms") and unc.get("step_ms") else None)
        for r in rs:
            r["gpus"] = meta["gpus"]
            r["link_bound"] = bound
            # every storage compressed (none copied raw): its bytes are the stored ones
            exact = r.get("stored_gib") and not (r.get("stats") or {}).get("offloaded_raw")
            host, unc_host = r["stored_gib"] if exact else r.get("host_gib"), unc.get("host_gib")
            r["ratio"] = unc_host / host if host and unc_host else None
            # None: the model is not deterministic; all zero: the check could not fail (a
            # gradient of zeros everywhere hides any restore's bytes)
            if none.get("grads") is not None and any(none["grads"]) and "grads" in r:
                r["grads_identical"] = r["grads"] == none["grads"]
    doc = {**meta, "rows": rows}
    if any("round" in r for r in rows):
        doc["summary"] = summary(rows)
    return doc


def summary(rows: list[dict]) -> list[dict]:
    """Per (model, variant, codec) over its rounds: the median, least and greatest step and
    the median against uncompressed's median (rows without a step, failed runs, left out)."""
    steps: dict = {}
    for r in rows:
        if r.get("step_ms") is not None and "error" not in r:
            steps.setdefault((r["model"], r["variant"], r.get("codec")), []).append(r["step_ms"])
    out = []
    for (model, variant, codec), ms in steps.items():
        unc = [v for (m, var, _), v in steps.items() if m == model and var == "uncompressed"]
        base = statistics.median(unc[0]) if unc else None
        med = statistics.median(ms)
        out.append({"model": model, "variant": variant, "codec": codec, "rounds": len(ms),
                    "step_ms_median": med, "step_ms_min": min(ms), "step_ms_max": max(ms),
                    "vs_uncompressed": med / base if base else None})
    return out


def table(doc: dict) -> str:
    # host GiB: the hooks' ledger peak (a storage at full size until its placement is read);
    # stored GiB: the compressed stores' placed bytes at their peak; held GiB: page-locked
    # memory held at the peak (the copy pool and the compressed arena)
    # host issue ms: the host's time per step, of which host wait ms waiting for packs and
    # hooks ms inside the pack and unpack hooks (``stats()["host_s"]``)
    head = ["model", "gpus", "variant", "codec", "step ms", "host issue ms", "host wait ms",
            "hooks ms", "vs uncompressed",
            "peak GPU GiB", "host GiB", "stored GiB", "held GiB", "ratio", "link-bound",
            "grads identical"]
    # against uncompressed of the same round where rounds were run (else the model's last)
    unc = {(r["model"], r.get("round")): r.get("step_ms") for r in doc["rows"]
           if r["variant"] == "uncompressed" and "error" not in r}
    rounds = any("round" in r for r in doc["rows"])
    if rounds:
        head.insert(3, "round")
    rows = []
    for r in doc["rows"]:
        first = [r["model"], str(r.get("gpus")), r["variant"]]
        first += [str(r.get("round", ""))] if rounds else []
        first += [r.get("codec") or ""]
        if "error" in r:
            rows.append(first + [f"error: {r['error']}"])
            continue
        base = unc.get((r["model"], r.get("round")))
        rel = f"{r['step_ms'] / base:.2f}x" if base else ""
        rows.append(first + [f"{r['step_ms']:.1f}", cell(r.get("host_issue_ms"), 1),
                             cell(r.get("host_wait_ms"), 1),
                             cell(sum(r["hook_host_ms"].values()) if r.get("hook_host_ms")
                                  else None, 1), rel,
                             cell(r.get("peak_gpu_gib")), cell(r.get("host_gib")),
                             cell(r.get("stored_gib")), cell(r.get("host_held_gib")),
                             cell(r.get("ratio"), 3), str(r["link_bound"]),
                             str(r.get("grads_identical", ""))])
    text = md_table(head, rows)
    if doc.get("summary"):
        text += "\n\n" + md_table(
            ["model", "variant", "codec", "rounds", "median step ms", "least - greatest",
             "median vs uncompressed's"],
            [[x["model"], x["variant"], x["codec"] or "", str(x["rounds"]),
              f"{x['step_ms_median']:.1f}", f"{x['step_ms_min']:.1f} - {x['step_ms_max']:.1f}",
              f"{x['vs_uncompressed']:.2f}x" if x["vs_uncompressed"] else ""]
             for x in doc["summary"]])
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="encoder-1024,encoder-2048,llama-2048,resnet-64")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--timeout", type=int, default=240)
    ap.add_argument("--device", default=None)
    ap.add_argument("--tiny", action="store_true", help="toy sizes of every model (CPU CI)")
    ap.add_argument("--fsdp", action="store_true",
                    help="FSDP2: each (model, variant) in its own torchrun of --nproc ranks; "
                         "started by torchrun itself, every variant in its ranks' processes")
    ap.add_argument("--nproc", type=int, default=None,
                    help="ranks per FSDP2 run (default: every GPU, 2 on the CPU)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", default=None, metavar="MODEL:VARIANT:PATH",
                    help="profile one more step of that run; the table goes to PATH")
    ap.add_argument("--min-offload-bytes", type=int, default=None,
                    help="the hooks' min_offload_bytes (default: theirs on a GPU, 4096 on "
                         "the CPU); the tiny models need a small one to offload on a GPU")
    ap.add_argument("--no-phases", action="store_true",
                    help="time the steps without recording where their peaks fall (the runs "
                         "before phase_gib existed did not; peak_gpu_gib is then the "
                         "allocator's peak over the timed steps)")
    ap.add_argument("--codec", default="auto",
                    help="the hooks' page codec: auto (bf16 / fp16 activations with the "
                         "exponent codec, the rest LZ4) or lz4; a list (auto,lz4) runs each "
                         "compressing variant once per codec")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every variant this many times per model, the order reversed "
                         "each round (a process's host speed drifts by 15-30%% on host-bound "
                         "models): rows carry their round, and a summary gives each variant's "
                         "median step against uncompressed's median")
    ap.add_argument("--child", nargs=2, metavar=("MODEL", "VARIANT"))
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    codecs = [c for c in args.codec.split(",") if c]
    bad = [c for c in codecs if c not in CODECS]
    if bad or not codecs:
        ap.error(f"--codec: each must be one of {CODECS}, got {args.codec!r}")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    models = [m for m in args.models.split(",") if m]
    if args.tiny:
        models = [m for m in MODELS if m.endswith("-tiny")]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        ap.error(f"--models: unknown {unknown}; choose from {', '.join(MODELS)}")
    from bench.public_models import available

    missing = [m for m in models if not available(MODELS[m][0])]
    if missing:
        ap.error(f"--models: {missing} need a library that is not installed "
                 "(transformers for gpt2/bert/hf-llama, torchvision for tv-*)")
    variants = args.variants.split(",")
    if args.child:
        print(json.dumps(run(*args.child, args.steps, args.warmup, args.device, False,
                             os.environ.get("STOCK_PROFILE"), args.min_offload_bytes,
                             not args.no_phases, codecs[0])))
        return 0
    meta = run_meta(args.device == "cuda")
    if args.fsdp and _under_torchrun():
        rows = _fsdp_rows(args, models, variants, meta, codecs)
        if rows is None:
            return 0  # not rank 0
    else:
        if args.fsdp:  # each (model, variant) in its own torchrun
            meta["gpus"] = args.nproc or (torch.cuda.device_count() if args.device == "cuda"
                                          else 2)
            if args.device == "cuda" and meta["gpus"] > torch.cuda.device_count():
                ap.error(f"--fsdp --nproc {meta['gpus']} on CUDA needs a GPU per rank "
                         f"({torch.cuda.device_count()} here); --device cpu runs gloo ranks")
            run_one = functools.partial(_torchrun_rows, args, nproc=meta["gpus"])
        else:  # each in a child process

            def run_one(m: str, v: str, c: str) -> list[dict]:
                return [_child(args, m, v, c)]
        rows = []
        for m in models:
            for r in range(args.rounds):
                for v in (variants if r % 2 == 0 else variants[::-1]):
                    for c in _codecs_of(v, codecs):
                        got = run_one(m, v, c)
                        if args.rounds > 1:
                            for row in got:
                                row["round"] = r + 1
                        rows.extend(got)
                        # after every row: a run cut off by its time limit keeps what it
                        # measured
                        partial = _finish([dict(row) for row in rows], meta)
                        write_results(partial, args.out, table(partial))
                        print(table({**partial, "summary": None}).splitlines()[-1],
                              file=sys.stderr, flush=True)
    doc = _finish(rows, meta)
    text = table(doc)
    print(text)
    write_results(doc, args.out, text)
    bad = [r for r in rows if "error" in r or r.get("exit_code", 0)]
    return 1 if bad else 0


def _under_torchrun() -> bool:
    """Whether this process is a rank that torchrun started (it sets these for every rank)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _torchrun_rows(args, name: str, variant: str, codec: str, nproc: int) -> list[dict]:
    """One (model, variant, codec) under FSDP2 in its own ``torchrun`` of ``nproc`` ranks: a
    fresh process group and CUDA context per run, as a user's job has: a variant run after
    another in one process measured slower than alone (bench/results/h200x2_643dbbc_fsdp). A
    run that fails or times out gives its row with ``"error"``."""
    import tempfile

    base = _row_key(name, variant, codec)
    if variant == "save_on_cpu":
        return []  # not run under FSDP2 (as in-process)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", str(nproc), "-m", "bench.stock_models", "--fsdp",
               "--models", name, "--variants", variant, *_run_args(args, codec), "--out", out]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                               env=env)
        except subprocess.TimeoutExpired:
            return [{**base, "error": f"timeout after {args.timeout} s"}]
        if r.returncode != 0 or not os.path.exists(out):
            return [{**base, "error": f"exit {r.returncode}", "stderr": r.stderr[-2000:]}]
        with open(out) as fh:
            return json.load(fh)["rows"]


def _fsdp_rows(args, models, variants, meta, codecs=("auto",)):
    """Every (model, variant) in this process group, one after another (torchrun).

    FSDP2 is imported before the group exists: imported first while one exists (from run()),
    it (its torch._dynamo import) keeps that group alive past ``destroy_process_group``, and
    the group's threads with it (see :func:`_join_process_group_threads`)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.fsdp  # noqa: F401  (before init_process_group: see above)

    if args.device == "cuda":
        # ranks on this host (torchrun sets LOCAL_WORLD_SIZE) against its GPUs
        here = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))
        gpus = torch.cuda.device_count()
        if here > gpus:  # NCCL refuses two ranks on one GPU, deep inside the first collective
            raise SystemExit(f"FSDP2 on CUDA needs a GPU per rank: {here} ranks on this host, "
                             f"{gpus} GPU(s); pass --device cpu to run the ranks on gloo")
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        args.device = f"cuda:{local}"
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    meta["gpus"] = world
    rows = []
    # No try/finally around the runs: a rank that fails must not wait at the barrier while
    # the others are inside another collective (that hangs); torchrun stops them instead.
    for m in models:
        for v in variants:
            if v == "save_on_cpu":
                continue
            for c in _codecs_of(v, list(codecs)):
                row = run(m, v, args.steps, args.warmup, args.device, True,
                          min_offload_bytes=args.min_offload_bytes, codec=c)
                gathered = [None] * world
                dist.all_gather_object(gathered, row)
                if rank == 0:
                    worst = max(gathered, key=lambda r: r["step_ms"])
                    worst["peak_gpu_gib"] = max(r.get("peak_gpu_gib", 0) for r in gathered)
                    hashes = [r["grads"] for r in gathered]
                    worst["grads"] = None if None in hashes else hashes
                    rows.append(worst)
                # the run's model, optimizer and offloader hold each other (module hooks):
                # collected now, or their GPU memory counts in the next variant's peak (it
                # raised later variants' peaks by up to 1.3 GiB, h200x2_abdfb70_fsdp)
                gc.collect()
                if args.device.startswith("cuda"):
                    torch.cuda.empty_cache()
    end_process_group(args.device.startswith("cuda"))
    return rows if rank == 0 else None


# thread names (Linux) of torch's process-group backends
_PG_THREADS = ("pt_gloo", "gloo_", "pt_nccl")


def _join_process_group_threads() -> None:
    """Free the process group now, so that its threads are joined while the interpreter is
    whole. ``destroy_process_group`` unregisters it, but FSDP2's device mesh stays referenced
    from DTensor's caches (the sharding propagator's, C++ and Python, and, on torch 2.11, the
    redistribute planner's and ``functools`` caches of transforms and strategies), and with it
    the group and its threads. A gloo worker drops each finished collective (and the Python
    tensors it holds) a little after the caller moved on; a drop that starts just before the
    interpreter finalizes waits for the GIL, is ended inside a destructor, and the process
    aborts ("terminate called without an active exception"). A backend thread still alive
    here is reported on stderr."""
    import functools

    import torch

    clear = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear is not None:
        clear()
    try:
        from torch.distributed.tensor import _redistribute

        _redistribute.clear_redistribute_planner_cache()
    except (ImportError, AttributeError):
        pass
    # every functools cache of torch.distributed, wherever it lives (module, class, closure):
    # which ones hold a mesh changes between torch releases
    caches = [obj for obj in gc.get_objects() if type(obj) is functools._lru_cache_wrapper
              and getattr(obj, "__module__", "").startswith("torch.distributed")]
    for cache in caches:
        cache.cache_clear()
    del caches
    gc.collect()
    tasks = "/proc/self/task"
    if not os.path.isdir(tasks):
        return
    left = []
    for tid in os.listdir(tasks):
        try:
            with open(f"{tasks}/{tid}/comm") as fh:
                name = fh.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        if name.startswith(_PG_THREADS):
            left.append(name)
    if left:
        # torch 2.11 keeps the mesh through objects no Python object refers to (DTensor
        # strategy tuples of its C++ dispatch; every cache above cleared, the C++ one's counters
        # at zero): a leak of that release, not a reference of ours, and its runs exit 0
        # (bench/results/h200x2_lifetimes_19e3aa2/). Reported, but on stderr only where torch
        # is expected to let go (a check that our teardown stays complete).
        known_leak = tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 13)
        print(f"stock_models: process-group threads outlived teardown: {sorted(left)}"
              + (" (torch < 2.13: DTensor's C++ dispatch keeps the mesh)" if known_leak else ""),
              file=sys.stdout if known_leak else sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
