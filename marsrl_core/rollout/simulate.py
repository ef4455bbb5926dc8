"""A discrete-event model of the MarsRL scheduler at paper scale, to plan a cluster.

It replays the rules of the pipelined train flow (`flows/train.py`, what `make train` runs) with
made-up lengths and stated throughputs instead of a model. Shared with that loop: batches admitted
while fewer than `batches_in_flight` are decoding (`flows/slots.py`), a downstream turn started when
the previous turn of its problem has finished, decoding in segments, a new policy version applied at
a stage boundary only within `max_staleness` (`RolloutScheduler`), and a learner that trains as soon
as an update's worth of finished groups is ready (the learner flow's poll). Not shared: the flow's
learner polls the store every 0.2 s and shares the machine with decoding, and the flow's
synchronous baseline decodes a batch in segments too. The model:
- problems arrive in batches of 128; each has a Solver group of 8 and, per downstream turn
  (Verifier, Corrector, Verifier, Corrector), 2 selected inputs x 8 samples; a turn starts when the
  previous turn of its problem has finished;
- output lengths are long-tailed (log-normal, median and spread per agent below), capped at the
  budgets (Solver 64K, Verifier 16K, Corrector 32K); a capped output is truncated;
- the rollout fleet decodes every in-flight sequence at `seq_tokens_per_s` each, up to a fleet-wide
  `fleet_tokens_per_s`; a stage decodes one segment (`segment_tokens`) per sequence and pays
  `stage_overhead_s` (scheduling, re-prefill of the prefix);
- the learner trains `train_tokens_per_s`; one update consumes the groups of `problems_per_update`
  problems' worth of samples (72 samples a problem);
- pipelined: problems are admitted whenever fewer than `batches_in_flight` x 128 are active; the learner
  trains as soon as an update's worth of finished groups is queued, concurrently with decoding; a
  new version reaches the rollout at the next stage boundary unless an in-flight sample would then
  span more than `max_staleness` versions (then admission pauses until it drains);
- synchronous: decode a batch to its end (no segments), then train on it, then the next batch.

Deliberate simplifications: a fluid throughput model (no KV-cache pressure, no prefill/decode
split, no network), every branch continues to all 5 turns (a slight over-estimate of work), and the
learner and the rollout fleet are separate machines in both modes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

TURN_AGENTS = ("solver", "verifier", "corrector", "verifier", "corrector")


@dataclass
class SimConfig:
    problems_per_update: int = 128
    batches_in_flight: int = 2  # as rollout.batches_in_flight: batch k's Verifiers beside batch k+1's Solvers
    solver_samples: int = 8
    downstream_inputs: int = 2
    downstream_samples: int = 8
    budgets: dict = field(default_factory=lambda: {"solver": 65536, "verifier": 16384, "corrector": 32768})
    median_tokens: dict = field(default_factory=lambda: {"solver": 14000, "verifier": 4000, "corrector": 9000})
    sigma: float = 0.8  # log-normal spread: a long tail reaching the budgets
    segment_tokens: int = 16384
    max_staleness: int = 2
    seq_tokens_per_s: float = 40.0  # per-sequence decode speed (a 30B-A3B model on a modern GPU)
    fleet_tokens_per_s: float = 60000.0  # rollout fleet's aggregate decode capacity
    train_tokens_per_s: float = 50000.0  # learner throughput (forward + backward)
    stage_overhead_s: float = 5.0
    updates: int = 8
    seed: int = 0


@dataclass
class SimResult:
    wall_clock_s: float
    learner_busy_s: float
    rollout_busy_s: float
    updates: int

    @property
    def learner_utilisation(self) -> float:
        return self.learner_busy_s / self.wall_clock_s

    @property
    def rollout_utilisation(self) -> float:
        return self.rollout_busy_s / self.wall_clock_s


class _Problem:
    def __init__(self, cfg: SimConfig, rng: np.random.Generator):
        self.cfg, self.rng, self.turn, self.tokens = cfg, rng, -1, 0
        self.live: list[list[float]] = []  # [remaining tokens, start version or -1]

    def next_turn(self) -> bool:
        self.turn += 1
        if self.turn >= len(TURN_AGENTS):
            return False
        agent = TURN_AGENTS[self.turn]
        n = self.cfg.solver_samples if self.turn == 0 else self.cfg.downstream_inputs * self.cfg.downstream_samples
        lengths = np.minimum(
            self.rng.lognormal(np.log(self.cfg.median_tokens[agent]), self.cfg.sigma, n), self.cfg.budgets[agent]
        )
        self.tokens += float(lengths.sum())
        self.live = [[float(x), -1.0] for x in lengths]
        return True


def _stage_time(cfg: SimConfig, decoded: list[float]) -> float:
    if not decoded:
        return 0.0
    return max(sum(decoded) / cfg.fleet_tokens_per_s, max(decoded) / cfg.seq_tokens_per_s) + cfg.stage_overhead_s


def simulate_synchronous(cfg: SimConfig) -> SimResult:
    rng = np.random.default_rng(cfg.seed)
    clock = learner_busy = rollout_busy = 0.0
    for _ in range(cfg.updates):
        problems = [_Problem(cfg, rng) for _ in range(cfg.problems_per_update)]
        for p in problems:
            p.next_turn()
        start = clock
        while any(p.live for p in problems):
            # No segments: one "stage" decodes every live output of the current turns to its end.
            clock += _stage_time(cfg, [r for p in problems for r, _ in p.live])
            for p in problems:
                p.live = []
                p.next_turn()
        rollout_busy += clock - start
        train = sum(p.tokens for p in problems) / cfg.train_tokens_per_s
        clock += train
        learner_busy += train
    return SimResult(clock, learner_busy, rollout_busy, cfg.updates)


def simulate_pipelined(cfg: SimConfig) -> SimResult:
    rng = np.random.default_rng(cfg.seed)
    clock = learner_busy = rollout_busy = 0.0
    version, pending_versions = 0, []  # completion times of updates not yet applied
    learner_free_at, queued_tokens, queued_problems, updates = 0.0, 0.0, 0, 0
    active: list[_Problem] = []
    admitting = True
    while updates < cfg.updates:
        # Apply finished updates at this stage boundary if the staleness bound allows.
        while pending_versions and pending_versions[0] <= clock:
            oldest = min((s for p in active for _, s in p.live if s >= 0), default=version + 1)
            if version + 1 - oldest > cfg.max_staleness:
                break
            pending_versions.pop(0)
            version += 1
        admitting = not (pending_versions and pending_versions[0] <= clock)
        while admitting and len(active) < cfg.batches_in_flight * cfg.problems_per_update:
            p = _Problem(cfg, rng)
            p.next_turn()
            active.append(p)
        decoded = []
        for p in active:
            for sample in p.live:
                step = min(cfg.segment_tokens, sample[0])
                decoded.append(step)
                sample[0] -= step
                if sample[1] < 0:
                    sample[1] = version
        dt = _stage_time(cfg, decoded)
        clock += dt
        rollout_busy += dt
        for p in list(active):
            p.live = [s for s in p.live if s[0] > 0]
            if not p.live and not p.next_turn():
                active.remove(p)
                queued_tokens += p.tokens
                queued_problems += 1
        # The learner trains concurrently whenever an update's worth of finished work is queued.
        while queued_problems >= cfg.problems_per_update and updates < cfg.updates:
            begin = max(learner_free_at, clock)
            take = queued_tokens * cfg.problems_per_update / queued_problems
            duration = take / cfg.train_tokens_per_s
            learner_free_at = begin + duration
            learner_busy += duration
            queued_tokens -= take
            queued_problems -= cfg.problems_per_update
            updates += 1
            pending_versions.append(learner_free_at)
    wall = max(clock, learner_free_at)
    return SimResult(wall, learner_busy, rollout_busy, updates)


def compare(cfg: SimConfig) -> dict[str, float]:
    sync, pipe = simulate_synchronous(cfg), simulate_pipelined(cfg)
    return {
        "sync_wall_s": sync.wall_clock_s,
        "pipelined_wall_s": pipe.wall_clock_s,
        "speedup": sync.wall_clock_s / pipe.wall_clock_s,
        "sync_learner_util": sync.learner_utilisation,
        "pipelined_learner_util": pipe.learner_utilisation,
        "sync_rollout_util": sync.rollout_utilisation,
        "pipelined_rollout_util": pipe.rollout_utilisation,
    }
