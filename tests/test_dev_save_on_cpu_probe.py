"""The probe of torch's ``save_on_cpu`` on a stock model (``bench.dev_save_on_cpu_probe``) on the
CPU, at toy size: each variant trains, the comparing variant finds every restored tensor equal
to what was saved (on the CPU nothing is pinned), and strides are counted."""

import pytest

pytest.importorskip("transformers")

from bench import dev_save_on_cpu_probe as probe  # noqa: E402


def test_each_variant_reports_its_steps_and_what_it_compared():
    for variant in ("none", "save_on_cpu_check", "save_on_cpu_strides", "save_on_cpu_nopin",
                    "save_on_cpu_nopin_contig"):
        lines = probe.run("t5-tiny", variant, 1, device="cpu")
        head = lines[0]
        assert head.startswith(f"{variant} step 0: loss ") and "inf/NaN gradients 0 of" in head
        if variant != "none":
            assert "'packed'" in head and "'unpacked'" in head
        assert "values_differ" not in head  # on the CPU the copies are done at once
    assert "inf/NaN gradients 0 of" in probe.run("t5-tiny", "save_on_cpu_keep", 1, device="cpu")[0]


def test_the_sdpa_layout_repro_compares_contiguous_restores_with_none():
    """``bench.dev_sdpa_layout_repro`` (the T5 failure without transformers) on the CPU's math
    attention: the contiguous restores' gradients are finite and, there, equal to the step
    without hooks, and it says so per step."""
    from bench import dev_sdpa_layout_repro as repro

    lines = repro.run("math", 2, 2, 32, 2, "float32", device="cpu")
    assert len(lines) == 2 and all("finite True, equal to no hooks' True" in ln
                                   for ln in lines), lines
