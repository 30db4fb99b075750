"""``bench.dev_class_mix.class_mix`` counts the classes a model's steps offload under a
compressing variant, with each class's ratio by codec, and puts the policy back as it was. On
the CPU (the hooks' CPU store) with a toy model, the step patched in for the probe's GPU one."""

import re

import torch

import bench.dev_hook_timing as timing
from bench.dev_class_mix import class_mix
from bench.stock_models import build
from torch_pagecomp import offload_module


def test_class_mix_counts_classes_and_restores_the_policy(monkeypatch):
    made = []

    def cpu_step(name, variant, fsdp=False):
        model, x, blocks = build(name, "cpu")
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        off = offload_module(model, blocks=blocks, prefer=variant, offload_cpu=True,
                             min_offload_bytes=1 << 12)
        made.append(off)

        def step():
            opt.zero_grad(set_to_none=True)
            model(x).float().square().mean().backward()
            opt.step()

        return step, off

    monkeypatch.setattr(timing, "training_step", cpu_step)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    text = class_mix("encoder-tiny", warmup=2, steps=1)
    rows = [line for line in text.splitlines() if line.startswith("| torch.")]
    assert rows, text
    mib = sum(float(r.split("|")[3]) for r in rows)
    total = float(re.search(r"offloaded ([\d.]+) MiB a step", text).group(1))
    assert abs(mib - total) < 0.1 * len(rows) + 1e-9
    # a bf16 class was sampled with both candidate codecs
    assert any("exp " in r and "lz4 " in r for r in rows), text
    off = made[0]
    assert "choose" not in vars(off.policy)  # the counting wrapper is gone
