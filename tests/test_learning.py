"""The CI learning test: a short MarsRL run, from the tiny preset's committed warm start, makes the Solver
and the Verifier better on held-out problems by more than the seed-to-seed spread of their evaluation.

The run (`tests.configs.learning_config`): the train flow for real (Prefect, DuckLake store, MLflow,
transformers engine, pipelined rollouts and learner), 50 learner steps on up to 20 batches of 8 problems,
evaluated before and after on 512 held-out problems x 2 samples at temperature 1: about 2 minutes
on 2 CPU cores, run twice (seeds 0 and 1).

The margins come from `benchmarks/learning_spread.py`, which ran this same run with seeds 0-4 (the
seed changes the held-out problems and all sampling; the warm start stays the same). The spread of a
measure before training is the noise of evaluating one fixed policy; if training changed nothing, a
gain would be the difference of two such evaluations, with standard deviation `sqrt(2) * sd_before`.
The test runs two seeds (0 and 1) and asserts on the mean of their gains, whose noise under that
null is `sd_before`; the margin is two of those, `2 * sd_before`, rounded up. Measured (5 seeds, on
the committed warm start): Solver 0.646 +- 0.009 before, 0.913 +- 0.011 after, gain 0.267 +- 0.013
(smallest 0.245); Verifier balanced accuracy 0.712 +- 0.013 before, 0.880 +- 0.031 after, gain
0.168 +- 0.032 (smallest 0.130).

Why two seeds: one seed-0 run was not reliable enough. Its Verifier gain varies from run to run
(the pipelined learner trains on whatever groups are ready when it looks): nine runs in scripts gave
0.82-0.91 after training, but two of four runs under pytest in CI gave 0.769 and 0.753, gains
within the noise. The mean of two runs halves the variance of the run-to-run part: from the five
seeds, a mean of two Verifier gains is 6.1 of its standard deviations above the 0.03 margin.

The learner's staleness bound matters here: a learner that drains a backlog of Verifier and Corrector
groups oldest first trains on samples 13-19 versions old, and the Verifier's gain then falls to
0.044 +- 0.041, within this test's margin.
"""

from __future__ import annotations

import pytest
from prefect.testing.utilities import prefect_test_harness

from tests.configs import learning_config

# From benchmarks/learning_spread.py, 5 seeds: the margin for a mean of two gains is 2 * sd_before, rounded up.
SOLVER_MARGIN = 0.02  # sd 0.009 before training
VERIFIER_MARGIN = 0.03  # sd 0.013 before training
SEEDS = (0, 1)


@pytest.fixture(scope="module", autouse=True)
def prefect_server():
    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.mark.slow
@pytest.mark.learning
def test_a_short_marsrl_run_improves_solver_and_verifier_beyond_the_seed_spread(tmp_path):
    from flows.train import train_flow

    gains = {"solver_acc": [], "verifier_bal_acc": []}
    seen = []
    for seed in SEEDS:
        result = train_flow(learning_config(tmp_path / f"seed{seed}", seed=seed))
        before, after = result["before"], result["after"]
        assert result["learner_steps"] == 50
        for key in gains:
            gains[key].append(after[key] - before[key])
        seen.append(
            f"seed {seed}: Solver {before['solver_acc']:.3f} -> {after['solver_acc']:.3f}, Verifier "
            f"{before['verifier_bal_acc']:.3f} -> {after['verifier_bal_acc']:.3f}"
        )
    solver_gain, verifier_gain = (sum(g) / len(g) for g in gains.values())
    assert solver_gain > SOLVER_MARGIN, "; ".join(seen)
    assert verifier_gain > VERIFIER_MARGIN, "; ".join(seen)
