"""The CI learning test: a short MarsRL run, from the tiny preset's committed warm start, makes the Solver
and the Verifier better on held-out problems by more than their seed-to-seed spread.

The run (`tests.configs.learning_config`): the train flow for real (Prefect, DuckLake store, MLflow,
transformers engine, pipelined rollouts and learner), 50 learner steps on 15 batches of 8 problems,
evaluated before and after on 256 held-out problems x 2 samples at temperature 1. It takes about 2
minutes on 2 CPU cores.

The margins come from `benchmarks/learning_spread.py`, which ran this same run with seeds 0-4 (the
seed changes the held-out problems, the evaluation's sampling and the run's sampling; the pipelined
run's timing adds its own variation). A margin is two standard deviations of a difference of two
measurements, `2 * sqrt(sd_before^2 + sd_after^2)`, from the standard deviations over seeds of the
measure before and after training, rounded up. Measured (5 seeds): Solver 0.574 +- 0.021 before,
0.827 +- 0.022 after, gain 0.254 +- 0.018 (smallest 0.234), margin 0.060; Verifier balanced accuracy
0.713 +- 0.014 before, 0.850 +- 0.029 after, gain 0.138 +- 0.035 (smallest 0.108), margin 0.064. The
Verifier's mean gain is two of its standard deviations above its margin: expect this test to fail about
one run in fifty by chance (30 learner steps gave a Verifier gain of 0.069 +- 0.033, too close to its
margin, hence 50).
"""

from __future__ import annotations

import pytest
from prefect.testing.utilities import prefect_test_harness

from tests.configs import learning_config

# From benchmarks/learning_spread.py, 5 seeds: margin = 2 * sqrt(sd_before^2 + sd_after^2), rounded up.
SOLVER_MARGIN = 0.06  # sd 0.021 before, 0.022 after
VERIFIER_MARGIN = 0.065  # sd 0.014 before, 0.029 after


@pytest.fixture(scope="module", autouse=True)
def prefect_server():
    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.mark.slow
def test_a_short_marsrl_run_improves_solver_and_verifier_beyond_the_seed_spread(tmp_path):
    from flows.train import train_flow

    result = train_flow(learning_config(tmp_path, seed=0))
    before, after = result["before"], result["after"]
    assert result["learner_steps"] == 50
    solver_gain = after["solver_acc"] - before["solver_acc"]
    verifier_gain = after["verifier_bal_acc"] - before["verifier_bal_acc"]
    assert solver_gain > SOLVER_MARGIN, f"Solver {before['solver_acc']:.3f} -> {after['solver_acc']:.3f}"
    assert verifier_gain > VERIFIER_MARGIN, (
        f"Verifier balanced accuracy {before['verifier_bal_acc']:.3f} -> {after['verifier_bal_acc']:.3f}")
