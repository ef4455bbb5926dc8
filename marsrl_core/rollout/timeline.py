"""A run's timeline: one lane per agent (what each rollout stage decoded, coloured by problem batch) and
one for the learner (its steps, each with the version it published), drawn with matplotlib.

The figure a user opens to see the agents overlap and the learner keep pace, and the first to open
when a speed-up disappoints: gaps in the agent lanes are the fleet idling, gaps in the learner lane
the learner waiting for groups.

From the store (`timeline_from_store`): each rollout stage commits its segments in one transaction,
so the segments' commit times are the stage boundaries and a stage spans the time since the previous
one; a learner step ends at its version's commit and spans its tokens over its throughput (both in
`train_steps`). A batch is read from its problems' ids (`b<batch>-...`). The simulator builds the same
`Timeline` from its own clock (`simulate.py`).

Run: `marsrl timeline RUN` (PNG, or SVG with `--out run.svg`).
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
from matplotlib import pyplot as plt  # noqa: E402

from marsrl_core.config import AGENTS  # noqa: E402

LANES = 3  # rows per agent lane: batches in flight are drawn on rows batch % LANES


@dataclass
class Timeline:
    """Stages as (start s, end s, {agent: batches it decoded}) and learner steps as (start s, end s,
    version), in seconds from the run's first stage."""

    stages: list[tuple[float, float, dict[str, set[int]]]] = field(default_factory=list)
    steps: list[tuple[float, float, int]] = field(default_factory=list)


def _batch(problem_id: str) -> int:
    head = problem_id.split("-", 1)[0]
    return int(head[1:]) if head[:1] == "b" and head[1:].isdigit() else 0


def timeline_from_store(store: Any, run_id: str) -> Timeline:
    """The run's stages and learner steps, read from its store."""
    rows = store.query(
        """SELECT epoch(g.created_at) AS at, s.agent, list(DISTINCT s.problem_id) AS problems
           FROM segments g JOIN samples s USING (run_id, sample_id) WHERE g.run_id = ? GROUP BY 1, 2 ORDER BY 1""",
        [run_id],
    ).to_pylist()
    timeline = Timeline()
    if not rows:
        return timeline
    by_time: dict[float, dict[str, set[int]]] = defaultdict(dict)
    for r in rows:
        by_time[r["at"]][r["agent"]] = {_batch(p) for p in r["problems"]}
    times = sorted(by_time)
    origin = times[0] - (times[1] - times[0] if len(times) > 1 else 1.0)  # the first stage: as long as the next
    previous = origin
    for at in times:
        timeline.stages.append((previous - origin, at - origin, by_time[at]))
        previous = at
    steps = store.query(
        """SELECT v.version, epoch(v.created_at) AS at, list(t.metrics_json) AS metrics
           FROM policy_versions v LEFT JOIN train_steps t ON t.run_id = v.run_id AND t.step = v.version
           WHERE v.run_id = ? GROUP BY 1, 2 ORDER BY 1""",
        [run_id],
    ).to_pylist()
    for s in steps:
        seconds = 0.0
        for text in s["metrics"] or []:
            if text:
                m = json.loads(text)
                seconds += m.get("tokens", 0.0) / m["tokens_per_s"] if m.get("tokens_per_s") else 0.0
        end = s["at"] - origin
        timeline.steps.append((max(0.0, end - seconds), end, s["version"]))
    return timeline


def draw_timeline(timeline: Timeline, title: str):
    """The figure: a lane per agent (rows by batch, colour by batch) and the learner's lane below."""
    colours = plt.get_cmap("tab10")
    lanes = [*AGENTS, "learner"]
    figure, axes = plt.subplots(figsize=(11, 1.1 * len(lanes) + 0.8))
    for lane, agent in enumerate(AGENTS):
        base = (len(lanes) - 1 - lane) * (LANES + 1)
        for start, end, decoded in timeline.stages:
            for batch in decoded.get(agent, ()):
                axes.broken_barh(
                    [(start, end - start)], (base + batch % LANES, 0.9), facecolors=colours(batch % 10), linewidth=0
                )
    for start, end, version in timeline.steps:
        axes.broken_barh([(start, max(end - start, 1e-3))], (0, LANES), facecolors="0.35", linewidth=0)
        axes.axvline(end, color="0.6", linewidth=0.5, zorder=0)
        axes.text(end, LANES + 0.1, f"v{version}", fontsize=6, ha="right", va="bottom")
    axes.set_yticks([(len(lanes) - 1 - i) * (LANES + 1) + LANES / 2 for i in range(len(lanes))], lanes)
    axes.set_xlabel("seconds from the first rollout stage (agent lanes: colour and row by problem batch)")
    axes.set_title(title)
    axes.set_ylim(-0.5, len(lanes) * (LANES + 1))
    figure.tight_layout()
    return figure


def write_timeline(timeline: Timeline, title: str, path: Path) -> Path:
    """Draw and save (PNG or SVG, by the file's suffix)."""
    figure = draw_timeline(timeline, title)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
