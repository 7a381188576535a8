"""Randomised stress with random SIGKILLs (about 20 s here; `python -m tools.stress` for long runs)."""

from __future__ import annotations

from tools import stress


def test_random_operations_with_random_sigkills_stay_correct() -> None:
    summary = stress.run(seconds=20, workers=4, kill_every=1.5, seed=1)
    assert summary["violations"] == [], summary
    assert summary["kills"] >= 5
    stats = summary["stats"]
    assert stats["computes"] > 0 and stats["hits_node"] + stats["hits_process"] > stats["computes"]


def test_a_sigkill_storm_inside_the_native_reads_stays_correct() -> None:
    """Six processes doing nothing but get_many / contains_many (a miss filled by put), killed
    every ~0.4 s once attached: the kills land inside the native calls and their stripe sections."""
    summary = stress.run(seconds=15, workers=6, kill_every=0.4, seed=2, workload=stress.Workload.READS)
    assert summary["violations"] == [], summary
    assert summary["kills"] >= 5
    stats = summary["stats"]
    assert stats["hits_node"] > 0 and stats["reaped_clients"] > 0
