"""The paper-scale simulation, small: the real scheduler, gate and learner rule on a simulated engine."""

from __future__ import annotations

import pytest

from marsrl_core.rollout.simulate import MODES, SimConfig, compare, simulate


def _small(**extra) -> SimConfig:
    return SimConfig(**{"problems_per_batch": 8, "updates": 3, "token_scale": 1024, **extra})


def test_every_mode_trains_as_much_and_the_pipelined_ones_are_faster_within_the_age_bound():
    figures = compare(_small())
    assert set(figures) == set(MODES)
    target = figures["synchronous"]["trained_samples"]
    assert target > 0 and figures["synchronous"]["learner_steps"] == 3
    for mode in ("batch_barrier", "streaming"):
        assert figures[mode]["trained_samples"] >= target
        assert figures[mode]["speedup"] > 1.0
        assert figures[mode]["trained_age_max"] <= 4  # the gate's eta (max_trained_age)
        assert 0.0 < figures[mode]["fleet_busy"] <= 1.0 and 0.0 < figures[mode]["learner_busy"] <= 1.0
    assert figures["synchronous"]["trained_age_max"] == 0  # trained on the policy that decoded it
    busy = figures["streaming"]
    per_agent = [busy[f"fleet_busy_{a}"] for a in ("solver", "verifier", "corrector")]
    assert busy["fleet_busy"] == pytest.approx(sum(per_agent))


def test_a_simulation_is_reproducible_and_its_gate_bounds_a_slow_learners_backlog():
    first, again = simulate(_small(), "streaming"), simulate(_small(), "streaming")
    assert first.wall_clock_s == again.wall_clock_s and first.trained == again.trained
    slow = {"train_tokens_per_s": 2000.0, "updates": 10}  # the rollouts outrun the learner
    gated = simulate(_small(max_trained_age=1, **slow), "streaming")
    ungated = simulate(_small(max_trained_age=None, **slow), "streaming")
    # Held back, the rollouts give the learner younger groups on average (measured: 1.18 against 1.77
    # versions). Its oldest can still be older: past max_trained_age a group is stale, and a step
    # trains stale groups newest first, after the fresh ones.
    assert gated.trained_age_mean < ungated.trained_age_mean - 0.3


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="mode='pipelined'"):
        simulate(_small(), "pipelined")
