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


def test_arms_in_blocks_time_every_round_of_each(capsys):
    """``--block``: each arm's rounds in a row (here all of them: each arm alone); every timed
    round still gets one step of each arm, printed per round with speed's way."""
    assert main(["--models", "encoder-tiny", "--arms", "none,uncompressed,speed", "--rounds",
                 "3", "--warmup", "1", "--block", "4", "--lead", "0"]) == 0
    out = capsys.readouterr().out
    assert "4 round(s) of an arm in a row" in out
    rows = out.split("per round: length | none | uncompressed | speed\n")[1].splitlines()
    assert len(rows) == 3, out
    assert all(len(r.split("|")) == 4 and r.split("|")[3].split()[1] in ("copy", "compress")
               for r in rows), rows
    with pytest.raises(SystemExit):
        main(["--models", "encoder-tiny", "--block", "0"])
