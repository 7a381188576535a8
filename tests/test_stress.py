"""Randomised stress with random SIGKILLs (about 20 s here; `python -m tools.stress` for long runs)."""

from __future__ import annotations

from tools import stress


def test_random_operations_with_random_sigkills_stay_correct() -> None:
    summary = stress.run(seconds=20, workers=4, kill_every=1.5, seed=1)
    assert summary["violations"] == [], summary
    assert summary["kills"] >= 5
    stats = summary["stats"]
    assert stats["computes"] > 0 and stats["hits_node"] + stats["hits_process"] > stats["computes"]
