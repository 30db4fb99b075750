"""``bench.dev_varlen`` (a new sequence length each step) on the CPU: its lengths, and a smoke
run of every arm on a tiny model."""

import pytest

from bench.dev_varlen import lengths_for, main


def test_lengths_are_seeded_multiples_of_8_within_a_quarter_and_the_whole():
    a = lengths_for("random", 1024, 50, seed=3)
    assert a == lengths_for("random", 1024, 50, seed=3) and len(set(a)) > 10
    assert all(256 <= n <= 1024 and n % 8 == 0 for n in a)
    assert lengths_for("fixed", 512, 3) == [512] * 3
    assert lengths_for("64,128", 512, 5) == [64, 128, 64, 128, 64]
    with pytest.raises(ValueError, match="1..512"):
        lengths_for("600", 512, 2)


def test_every_arm_runs_on_a_tiny_model(capsys):
    assert main(["--models", "encoder-tiny", "--arms",
                 "none,save_on_cpu,uncompressed,memory,speed", "--rounds", "3",
                 "--warmup", "1"]) == 0
    out = capsys.readouterr().out
    for arm in ("none", "save_on_cpu", "uncompressed", "memory", "speed"):
        assert f"| {arm} | " in out
    assert "speed's tuner: phase" in out
    with pytest.raises(SystemExit):
        main(["--models", "resnet-tiny"])  # images, not sequences
