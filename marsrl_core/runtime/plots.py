"""Per-agent reward curves of a run, drawn from the store's `train_steps` table with matplotlib.

Deliberately plain: one line per agent (the mean reward of the groups each learner step consumed),
no smoothing, the Agg backend (no display needed).
"""

from __future__ import annotations

import json

import matplotlib

matplotlib.use("Agg")
from matplotlib import pyplot as plt  # noqa: E402

from marsrl_core.store import Store  # noqa: E402


def reward_curves(store: Store, run_id: str):
    """A figure with each agent's mean training reward per learner step."""
    rows = store.query(
        "SELECT step, agent, metrics_json FROM train_steps WHERE run_id = ? ORDER BY step", [run_id]
    ).to_pylist()
    curves: dict[str, tuple[list[int], list[float]]] = {}
    for row in rows:
        metrics = json.loads(row["metrics_json"])
        if "reward_mean" in metrics:
            steps, values = curves.setdefault(row["agent"], ([], []))
            steps.append(row["step"])
            values.append(metrics["reward_mean"])
    figure, axes = plt.subplots(figsize=(7, 4))
    for agent, (steps, values) in sorted(curves.items()):
        axes.plot(steps, values, marker=".", label=agent)
    axes.set(xlabel="learner step", ylabel="mean reward", title=f"rewards per agent: {run_id}", ylim=(-0.05, 1.05))
    axes.grid(alpha=0.3)
    if curves:
        axes.legend()
    figure.tight_layout()
    return figure
