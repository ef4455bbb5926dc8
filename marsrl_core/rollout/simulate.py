"""The pipeline at paper scale, simulated: the real scheduler, gate and learner readiness rule on a
simulated engine and clock, to plan a cluster and to see where a speed-up comes from.

What runs for real: `RolloutScheduler` (admission, segments, `max_version_span`, downstream groups
created per problem as their inputs complete, or, as the comparison, at a per-batch turn barrier),
`AdmissionGate` (the learner's pace), `learn.groups.ready_groups` (when the learner takes a step and
which groups), and a DuckLake store in a temporary folder that they all read and write.

What is simulated (`SimConfig`):
- outputs: long-tailed lengths (log-normal, median and spread per agent), capped at the budgets
  (Solver 64K, Verifier 16K, Corrector 32K, truncated when capped); a Solver or Corrector answer is
  right, and a Verifier says Wrong, with probability one half, judged by `sim_judge`. To keep the
  store small, one simulated token stands for `token_scale` real ones (segments, budgets and lengths
  divided by it; every time below counts real tokens);
- the rollout fleet: a stage decodes one segment of every unfinished sample and takes
  max(tokens / fleet_tokens_per_s, longest segment / seq_tokens_per_s) + stage_overhead_s (scheduling,
  re-prefill); a stage that decodes nothing waits for the learner's next version;
- the learner: a step trains its samples' tokens at `train_tokens_per_s`, beside the rollout (its own
  machines); it polls the store at stage ends and after each step, and a new version reaches the
  engine at the first stage boundary after the step ends (within `max_version_span`);
- synchronous: one batch decoded whole (in segments, each problem's agents one after another), then
  trained on, step after step, then the next batch, as `rollout.synchronous` runs.

It reports per mode the wall-clock to `updates` learner steps, the fleet's and the learner's busy
fraction (per agent too: the seed's pitfall, "if one agent is much slower, the pipeline doesn't
parallelize"), the age of the trained samples and the engine's mean decode batch.

Deliberate simplifications: a fluid throughput model (no KV-cache pressure, no prefill/decode split,
no network); the learner polls at stage ends, so it may take a group that finished during the stage
it polls after; the learner and the rollout fleet are separate machines in every mode.

Run: `python benchmarks/pipeline_bench.py` (with the flows' measurements), or `compare(SimConfig())`.
"""

from __future__ import annotations

import itertools
import tempfile
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from marsrl_core.agents.problems import Problem
from marsrl_core.agents.rewards import Judgement
from marsrl_core.agents.roles import CORRECT, TINY_TEMPLATES, VERIFIER, WRONG, Roles
from marsrl_core.config import AGENTS, load_config
from marsrl_core.demo.tiny import build_tiny_tokenizer
from marsrl_core.engines.base import SegmentResult
from marsrl_core.learn.groups import ready_groups
from marsrl_core.rollout.gate import AdmissionGate
from marsrl_core.rollout.scheduler import RolloutScheduler
from marsrl_core.rollout.timeline import Timeline, write_timeline
from marsrl_core.rollout.weights import WeightChannel
from marsrl_core.store import SegmentStore

MODES = ("synchronous", "batch_barrier", "streaming")
ROLE_OF_LETTER = {"S": "solver", "V": "verifier", "C": "corrector"}
RUN = "sim"


@dataclass
class SimConfig:
    problems_per_batch: int = 128
    batches_in_flight: int = 3  # as the paper preset's rollout.batches_in_flight
    solver_samples: int = 8
    downstream_inputs: int = 2
    downstream_samples: int = 8
    budgets: dict = field(default_factory=lambda: {"solver": 65536, "verifier": 16384, "corrector": 32768})
    median_tokens: dict = field(default_factory=lambda: {"solver": 14000, "verifier": 4000, "corrector": 9000})
    sigma: float = 0.8  # log-normal spread: a long tail reaching the budgets
    segment_tokens: int = 16384
    max_version_span: int = 2
    max_trained_age: int | None = 4  # the gate's eta (learner.max_trained_age); None: no gate
    seq_tokens_per_s: float = 40.0  # per-sequence decode speed (a 30B-A3B model on a modern GPU)
    fleet_tokens_per_s: float = 60000.0  # rollout fleet's aggregate decode capacity
    train_tokens_per_s: float = 50000.0  # learner throughput (forward + backward)
    stage_overhead_s: float = 5.0
    updates: int = 8  # learner steps to reach; a step takes one batch's worth of groups of each agent
    token_scale: int = 256  # real tokens per simulated token
    seed: int = 0


@dataclass
class SimResult:
    mode: str
    wall_clock_s: float
    updates: int
    trained: int  # samples the steps consumed
    fleet_busy_s: Counter  # decoding, per agent
    fleet_token_use: float  # tokens decoded over what the fleet could have decoded
    learner_busy_s: Counter
    trained_age_mean: float
    trained_age_max: int
    decode_batch_mean: float

    def as_dict(self) -> dict[str, Any]:
        wall = self.wall_clock_s
        return {
            "wall_clock_h": wall / 3600,
            "learner_steps": self.updates,
            "trained_samples": self.trained,
            "fleet_busy": sum(self.fleet_busy_s.values()) / wall,
            "fleet_token_use": self.fleet_token_use,
            "learner_busy": sum(self.learner_busy_s.values()) / wall,
            **{f"fleet_busy_{a}": self.fleet_busy_s[a] / wall for a in AGENTS},
            **{f"learner_busy_{a}": self.learner_busy_s[a] / wall for a in AGENTS},
            "trained_age_mean": self.trained_age_mean,
            "trained_age_max": self.trained_age_max,
            "decode_batch_mean": self.decode_batch_mean,
        }


class Clock:
    def __init__(self) -> None:
        self.now = 0.0


class SimEngine:
    """Decodes segments of made-up length: each sample's length is drawn once from its sampling seed."""

    def __init__(self, sim: SimConfig, clock: Clock, segment_tokens: int):
        self.sim, self.clock, self.segment_tokens = sim, clock, segment_tokens
        self.tokenizer = build_tiny_tokenizer()
        self.policy_version = 0
        self.max_positions = None
        self.filler = self.tokenizer.convert_tokens_to_ids("x")
        self.ends = {c: self.tokenizer.convert_tokens_to_ids(c) for c in "RWC"}  # right, "Wrong", "Correct"
        self.stages: list[tuple[float, float, Counter[str]]] = []  # (start, decode time, real tokens per agent)
        self.timeline = Timeline()
        self.batch_sizes: list[int] = []

    def _length_and_end(self, agent: str, seed: int) -> tuple[int, int]:
        rng = np.random.default_rng(seed)
        real = min(rng.lognormal(np.log(self.sim.median_tokens[agent]), self.sim.sigma), self.sim.budgets[agent] + 1)
        outcome = rng.random() < 0.5
        end = ("W" if outcome else "C") if agent == VERIFIER else ("R" if outcome else "x")
        return max(1, int(real) // self.sim.token_scale), self.ends.get(end, self.filler)

    def decode_segment(self, requests) -> list[SegmentResult]:
        results, real_tokens, batches = [], Counter(), {}
        longest = 0
        for r in requests:
            head = self.tokenizer.decode(list(r.prompt_ids[:12]))  # "S|<batch>.<problem>|..."
            agent = ROLE_OF_LETTER[head[0]]
            batches.setdefault(agent, set()).add(int(head[2:].split(".")[0]))
            length, end = self._length_and_end(agent, r.sampling.seed)
            done = len(r.prefix_ids)
            n = min(length - done, r.max_new_tokens)
            finished = done + n == length
            tokens = [self.filler] * (n - 1) + [end if finished else self.filler] if n > 0 else []
            results.append(SegmentResult(tokens, [0.0] * len(tokens), finished, self.policy_version))
            real_tokens[agent] += n * self.sim.token_scale
            longest = max(longest, n * self.sim.token_scale)
        total = sum(real_tokens.values())
        stage_s = max(total / self.sim.fleet_tokens_per_s, longest / self.sim.seq_tokens_per_s)
        self.stages.append((self.clock.now, stage_s, real_tokens))
        self.timeline.stages.append((self.clock.now, self.clock.now + stage_s, batches))
        self.clock.now += stage_s + self.sim.stage_overhead_s
        self.batch_sizes.append(len(requests))
        return results

    def busy(self, until: float) -> tuple[Counter[str], float]:
        """Decoding time per agent up to `until` (each stage's time shared out by its tokens), and the
        tokens decoded by then over what the fleet could have decoded."""
        busy, tokens = Counter(), 0.0
        for start, length, by_agent in self.stages:
            part = min(1.0, max(0.0, (until - start) / length)) if length else 0.0
            total = sum(by_agent.values())
            for agent, n in by_agent.items():
                busy[agent] += part * length * n / max(1, total)
            tokens += part * total
        return busy, tokens / (self.sim.fleet_tokens_per_s * until)

    def update_weights(self, version: int, weights: Any) -> None:
        self.policy_version = version


def sim_judge(agent: str, text: str, *, judged_solution_correct: bool | None = None, truncated: bool = False, **_):
    """`agents.rewards.judge` for the simulated outputs: the last character says it all."""
    if agent == VERIFIER:
        verdict = WRONG if text.endswith("W") else CORRECT
        right = (verdict == CORRECT) == judged_solution_correct and not truncated
        return Judgement(float(right), right, "truncated" if truncated else "ok", verdict)
    right = text.endswith("R") and not truncated
    return Judgement(float(right), right, "truncated" if truncated else "ok", "1" if right else "0")


class SimLearner:
    """What `ready_groups` reads of a learner, and a step's bookkeeping: the groups it trains, how long
    it takes, and when its version becomes available."""

    def __init__(self, sim: SimConfig, cfg: Any, store: SegmentStore):
        self.sim, self.cfg, self.store, self.run_id = sim, cfg, store, RUN
        self.step = 0
        self.busy_s: Counter[str] = Counter()
        self.running: tuple[float, dict[str, list[str]]] | None = None  # (ends at, agent -> sample ids)
        self.started_at = 0.0
        self.steps: list[tuple[float, float, int]] = []  # (start, end, version)

    @property
    def trained(self) -> int:
        """Samples the committed steps consumed."""
        return self.store.count("consumptions", RUN)

    def start(self, now: float, flush: bool = False) -> bool:
        """Take the groups a step would take now; False when none is ready."""
        groups = ready_groups(self, flush=flush)
        if not groups:
            return False
        consumed: dict[str, list[str]] = {}
        for g in groups:
            consumed.setdefault(g.agent, []).extend(g.sample_ids)
        duration = 0.0
        for agent, ids in consumed.items():
            tokens = (
                self.store.query(
                    "SELECT CAST(coalesce(sum(len(token_ids)), 0) AS BIGINT) AS n FROM segments WHERE run_id = ? "
                    "AND list_contains(?, sample_id)",
                    [RUN, ids],
                )
                .column("n")[0]
                .as_py()
                * self.sim.token_scale
            )
            self.busy_s[agent] += tokens / self.sim.train_tokens_per_s
            duration += tokens / self.sim.train_tokens_per_s
        self.running = (now + duration, consumed)
        self.started_at = now
        return True

    def finish(self) -> float:
        """Commit the running step (its version now exists); the time it ended."""
        ends_at, consumed = self.running
        self.step += 1
        self.store.commit_step(RUN, self.step, consumed, f"sim/{self.step}")
        self.steps.append((self.started_at, ends_at, self.step))
        self.running = None
        return ends_at


def _marsrl_config(sim: SimConfig, folder: str, mode: str):
    scale = sim.token_scale
    per_problem_downstream = sim.downstream_inputs * 2  # two Verifier turns, up to two Corrector turns
    overrides = {
        "store.catalog_url": f"sqlite:{folder}/lake.sqlite",
        "store.data_path": f"{folder}/data",
        "rollout.num_generations": sim.solver_samples,
        "rollout.downstream_generations": sim.downstream_samples,
        "rollout.select_inputs": sim.downstream_inputs,
        "rollout.max_turns": 5,
        "rollout.segment_tokens": sim.segment_tokens // scale,
        **{f"rollout.{a}_max_tokens": sim.budgets[a] // scale for a in AGENTS},
        "rollout.problems_per_batch": sim.problems_per_batch,
        "rollout.batches_in_flight": sim.batches_in_flight,
        "rollout.max_version_span": sim.max_version_span,
        "rollout.synchronous": mode == "synchronous",
        "rollout.explore": 0.0,
        "learner.groups_per_step": sim.problems_per_batch,
        "learner.downstream_groups_per_step": sim.problems_per_batch * per_problem_downstream,
        "learner.max_trained_age": "null" if sim.max_trained_age is None else sim.max_trained_age,
        "learner.max_steps": sim.updates,
    }
    return load_config("paper", None, [f"{k}={v}" for k, v in overrides.items()])


def simulate(
    sim: SimConfig, mode: str, until_trained: int | None = None, timeline_path: Path | None = None
) -> SimResult:
    """One run of `mode` (`MODES`) until its learner has taken `sim.updates` steps, or, with
    `until_trained`, until its steps have trained that many samples; its timeline drawn to
    `timeline_path` when given (`rollout/timeline.py`)."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: choose one of {MODES}")
    with tempfile.TemporaryDirectory() as folder:
        cfg = _marsrl_config(sim, folder, mode)
        store = SegmentStore.from_config(cfg.store)
        store.create_run(RUN, {})
        clock = Clock()
        engine = SimEngine(sim, clock, cfg.rollout.segment_tokens)
        learner = SimLearner(sim, cfg, store)
        gate = None
        if mode != "synchronous" and sim.max_trained_age is not None:
            gate = AdmissionGate(store, RUN, cfg.learner.groups_per_step_by_agent(), sim.max_trained_age, 0.0)

        def done() -> bool:
            return learner.step >= sim.updates if until_trained is None else learner.trained >= until_trained

        roles = Roles.from_config(base=TINY_TEMPLATES)
        scheduler = RolloutScheduler(
            cfg,
            store,
            RUN,
            engine,
            engine.tokenizer,
            roles,
            seed=sim.seed,
            weights=WeightChannel(store, RUN),
            gate=gate,
            judge=sim_judge,
            turn_barrier=mode == "batch_barrier",
            new_group_id=lambda counter=itertools.count(): f"g{next(counter):07d}",  # reproducible lengths
        )
        for b in range(4 * sim.updates + sim.batches_in_flight):
            problems = [Problem(f"b{b}-{i}", f"{b}.{i}", "1") for i in range(sim.problems_per_batch)]
            scheduler.add_problems(problems, batch=b)
        if mode == "synchronous":
            _run_synchronous(scheduler, learner, clock, done)
        else:
            _run_pipelined(scheduler, learner, clock, done)
        ages = store.query("SELECT avg(staleness) AS mean, max(staleness) AS oldest FROM staleness").to_pylist()[0]
        fleet_busy, fleet_tokens = engine.busy(clock.now)
        if timeline_path is not None:
            engine.timeline.steps = learner.steps
            write_timeline(engine.timeline, f"simulated {mode} run, paper scale (hours x 3600)", timeline_path)
        result = SimResult(
            mode,
            clock.now,
            learner.step,
            learner.trained,
            fleet_busy,
            fleet_tokens,
            learner.busy_s,
            float(ages["mean"] or 0.0),
            int(ages["oldest"] or 0),
            float(np.mean(engine.batch_sizes)) if engine.batch_sizes else 0.0,
        )
        scheduler.release()
        store.close()
    return result


def _run_synchronous(scheduler: RolloutScheduler, learner: SimLearner, clock: Clock, done) -> None:
    while not done():
        scheduler.stage()  # admits a batch when idle
        while scheduler.active_problems:
            scheduler.stage()
        while not done() and learner.start(clock.now, flush=True):
            clock.now = learner.finish()  # the next stage takes the new version


def _run_pipelined(scheduler: RolloutScheduler, learner: SimLearner, clock: Clock, done) -> None:
    """Stages on the fleet; the learner's steps beside them, each committed once the clock has passed its
    end; the clock ends at the last step's end. Raises if neither moves for a few stages (a gate that
    waits on a learner that waits on it)."""
    still = 0
    while True:
        report = scheduler.stage()
        if learner.running is None:
            learner.start(clock.now)
        moved = report.decoded or report.admitted or report.new_samples or learner.running is not None
        still = 0 if moved else still + 1
        if still > 3:
            raise RuntimeError(f"the simulated run stalled at learner step {learner.step}: {scheduler.stats}")
        while learner.running is not None and learner.running[0] <= clock.now:
            ended = learner.finish()
            if done():
                clock.now = ended
                return
            learner.start(ended)
        if not report.decoded and learner.running is not None:  # nothing to decode: wait for the next version
            clock.now = max(clock.now, learner.running[0])


def compare(sim: SimConfig, modes: tuple[str, ...] = MODES) -> dict[str, dict[str, Any]]:
    """Each mode's figures. The synchronous run takes `sim.updates` steps; the others run until they
    have trained as many samples (their steps take what is ready, so they differ in size), and their
    speed-up is the synchronous wall-clock over theirs."""
    results = {}
    target = None
    if "synchronous" in modes:
        results["synchronous"] = simulate(sim, "synchronous")
        target = results["synchronous"].trained
    for mode in modes:
        if mode != "synchronous":
            results[mode] = simulate(sim, mode, until_trained=target)
    figures = {mode: r.as_dict() for mode, r in results.items()}
    if "synchronous" in results:
        for mode, r in results.items():
            figures[mode]["speedup"] = results["synchronous"].wall_clock_s / r.wall_clock_s
    return figures


__all__ = ["MODES", "SimConfig", "SimResult", "compare", "replace", "simulate"]
