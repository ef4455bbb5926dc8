"""The learner: per-agent GRPO/PPO steps on complete groups from the store, and version publishing.

One `train_step(groups)`:
1. rebuilds the groups' samples from the store (prompt, response tokens, behaviour log-probs);
2. computes group-normalised advantages per same-input group, dropping (and counting) groups with
   zero reward variance;
3. per agent, runs the policy over micro-batches and back-propagates the PPO-clip loss against the
   behaviour log-probs (`agent_loss.backward`; the normalizers weigh the agents that share a policy
   as `agent_weighting` says);
4. clips gradients and steps the optimizer of each policy that received gradients. A non-finite loss
   or gradient norm skips the whole update (`skipped_nonfinite`): its samples are consumed and its
   version holds the weights as they were. An update that makes a parameter non-finite or larger than
   `learner.max_weight_abs` stops the run (`PolicyDiverged`): that step is never published;
5. publishes version `step` (`versions.py`): its folder is written (temporary folder, then renamed),
   then the consumptions, the version row and the metrics commit in one store transaction.

Groups flagged `stale` (older than `learner.max_trained_age` policy versions, see `groups.ready_groups`)
are trained on with decoupled PPO's correction (`stale_groups='correct'`, the default) or dropped
untrained (`stale_groups='drop'`: recorded as dropped, so they are never offered again).

Several ranks (`distributed`; `marsrl learn --nproc N`, or a launcher): rank 0 runs `train_step` and
starts each step on the others, which `follow()`; every rank trains its share of the samples and the
summed gradients give the one-process update; rank 0 alone reads the store and commits. With
`learner.sequence_parallel = N` the samples are shared by groups of N ranks, each of which runs 1/N of
every row (`sequence_parallel`).

Policies: `shared` (one model for all roles, the paper) or `per_agent` (a model, AdamW and warm-up
schedule per agent). Resuming and publishing versions (durable every `learner.save_every` steps) is
`versions.py`.

Deliberate simplifications: one optimizer step per batch (no PPO epochs); log-probs use the rollout
temperature as the engines do; the reference model for `beta > 0` is the starting policy, frozen.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from marsrl_core.config import MarsRLConfig
from marsrl_core.devices import (
    compute_dtype,
    master_dtype,
    peak_memory_gb,
    reset_peak_memory,
    resolve_device,
)
from marsrl_core.divergence import PolicyDiverged
from marsrl_core.faults import crash_point
from marsrl_core.learn import distributed
from marsrl_core.learn.agent_loss import (
    MAXED,
    SUMMED,
    TrainItem,
    backward,
    finish_metrics,
    loss_normalizers,
    pack,
    train_items,
)
from marsrl_core.learn.checkpoint_folders import SHARED_POLICY, policy_names
from marsrl_core.learn.models import load_model, shard_and_fill
from marsrl_core.learn.scoring import TokenScorer
from marsrl_core.learn.sequence_parallel import SequenceGroup, check_heads
from marsrl_core.learn.versions import DURABLE, DurableWriter, LearnerVersions
from marsrl_core.store import SegmentStore, TrainableGroup
from marsrl_core.timings import timed


@dataclass
class StepReport:
    step: int
    checkpoint: Path
    consumed: dict[str, list[str]]
    metrics: dict[str, dict[str, float]] = field(default_factory=dict)
    skipped_nonfinite: bool = False


class Learner(LearnerVersions):
    def __init__(
        self,
        cfg: MarsRLConfig,
        store: SegmentStore,
        run_id: str,
        start_folder: Path,
        checkpoint_root: Path,
        tokenizer: Any = None,
        tracker: Any = None,
        ranks: distributed.Ranks | None = None,
    ):
        self.cfg, self.store, self.run_id, self.tracker = cfg, store, run_id, tracker
        self.checkpoint_root = Path(checkpoint_root)
        self.tokenizer = tokenizer
        self.ranks = ranks
        lc = cfg.learner
        self.device = resolve_device(cfg.model.device)
        self.autocast = compute_dtype(cfg)
        self.temperature = cfg.rollout.temperature or 1.0
        self.sharded = ranks is not None and lc.fsdp
        names = policy_names(per_agent=lc.policies == "per_agent")
        load = lambda dtype: load_model(start_folder, cfg, dtype, self.device, empty=self.sharded)
        self.models = {name: load(master_dtype(cfg)) for name in names}
        self.sequence = None  # Ulysses: this rank's group of `learner.sequence_parallel` ranks sharing each row
        if lc.sequence_parallel > 1:
            check_heads(next(iter(self.models.values())).config, lc.sequence_parallel)
            self.sequence = SequenceGroup.form(ranks, lc.sequence_parallel)
        self.scorers = {name: self._scorer(m) for name, m in self.models.items()}
        self.reference = None
        if lc.beta > 0:  # frozen, so no fp32 master copy
            self.reference = self._scorer(load(getattr(torch, cfg.model.dtype)).eval().requires_grad_(False))
        if self.sharded:  # FSDP2 computes in bf16 itself (MixedPrecisionPolicy), so no autocast on top
            frozen = [self.reference] if self.reference is not None else []
            shard_and_fill([*self.scorers.values(), *frozen], start_folder, cfg, self.device, self.autocast, ranks)
            self.autocast = None
        self.optimizers = {  # after sharding: each rank's AdamW holds the state of its own shards
            # fused: one kernel over all parameters, without the parameter-sized temporaries of `foreach`
            name: torch.optim.AdamW(
                m.parameters(), lr=lc.learning_rate, eps=lc.adam_epsilon, weight_decay=lc.weight_decay, fused=True
            )
            for name, m in self.models.items()
        }
        warmup = lc.warmup_steps
        self.schedulers = {
            name: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)
            for name, opt in self.optimizers.items()
        }
        # The loss's settings (`learner.*`), passed to `algorithms.policy_loss` on every micro-batch.
        self.loss_options = {
            "epsilon": lc.epsilon,
            "epsilon_high": lc.epsilon_high,
            "loss_type": lc.loss_type,
            "beta": lc.beta,
            "tis_cap": lc.tis_cap,
            "tis_mode": lc.tis_mode,
            "clip_ratio_c": lc.clip_ratio_c,
        }
        self.step = 0
        self.logged_version = 0  # newest version logged to MLflow
        self.writer = DurableWriter()  # `learner.async_save`

    def _scorer(self, model) -> TokenScorer:
        return TokenScorer(model, self.cfg.learner.logprob_chunk_tokens, self.temperature, self.sequence)

    def policy_name(self, agent: str) -> str:
        return SHARED_POLICY if SHARED_POLICY in self.models else agent

    def model_for(self, agent: str):
        return self.models[self.policy_name(agent)]

    # ------------------------------------------------------------------ one step
    def train_step(self, groups: Sequence[TrainableGroup]) -> StepReport:
        """One step on `groups` (with several ranks, on rank 0: it starts the step on the others)."""
        if self.ranks is not None:
            distributed.broadcast(list(groups), self.ranks.control)
        return self._step(groups)

    def follow(self) -> int:
        """Ranks > 0: take part in every step rank 0 starts, until it stops them (`stop_followers`);
        returns the last step."""
        while (groups := distributed.broadcast(None, self.ranks.control)) is not None:
            if groups == DURABLE:  # rank 0's `make_durable`
                self._write_version(durable=True)
                distributed.barrier(self.ranks.control)
            else:
                self._step(groups)
        return self.step

    def stop_followers(self) -> None:
        """Rank 0, when it is done: the other ranks' `follow` returns."""
        if self.ranks is not None:
            distributed.broadcast(None, self.ranks.control)

    def _step(self, groups: Sequence[TrainableGroup]) -> StepReport:
        start = time.perf_counter()
        groups, dropped = self._select(groups)
        ids = [sid for g in groups for sid in g.sample_ids]
        with timed("learner.load_samples"):
            samples = self.store.load_samples(self.run_id, ids) if self.ranks is None or self.ranks.main else None
        if self.ranks is not None:
            samples = distributed.broadcast(samples)
        per_agent, stats = train_items(groups, samples, self.cfg.learner)
        metrics, nonfinite = self._update(per_agent)
        self.step += 1
        self._record(metrics, stats, dropped, nonfinite, time.perf_counter() - start)
        consumed: dict[str, list[str]] = {}
        for g in groups:
            consumed.setdefault(g.agent, []).extend(g.sample_ids)
        crash_point("learner.update")
        folder = self.publish(consumed, metrics, dropped)
        return StepReport(self.step, folder, consumed, metrics, nonfinite)

    def _select(self, groups: Sequence[TrainableGroup]) -> tuple[list[TrainableGroup], dict[str, list[str]]]:
        """The groups the step trains on, and (with `stale_groups='drop'`) the stale ones it drops."""
        dropped: dict[str, list[str]] = {}
        if self.cfg.learner.stale_groups != "drop":
            return list(groups), dropped
        for g in groups:
            if g.stale:
                dropped.setdefault(g.agent, []).extend(g.sample_ids)
        return [g for g in groups if not g.stale], dropped

    def _update(self, per_agent: dict[str, list[TrainItem]]) -> tuple[dict[str, dict[str, float]], bool]:
        """Gradients, clipping and one optimizer step per trained policy; the agents' metrics, and whether
        a loss or gradient norm was non-finite (then no update at all: the step's samples are consumed
        and its version holds the weights as they were)."""
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=True)
        reset_peak_memory(self.device)
        with timed("learner.forward_backward"):
            metrics = self._accumulate_gradients(per_agent)
        trained = sorted({self.policy_name(a) for a in per_agent})
        with timed("learner.optimizer"):
            nonfinite = self._clip(trained, per_agent, metrics)
        if not nonfinite:
            self.wait_for_durable()  # a background durable write reads the tensors this update changes
            with timed("learner.optimizer"):
                for name in trained:
                    self.optimizers[name].step()
                    self.schedulers[name].step()
                    self._check_weights(name)
        for opt in self.optimizers.values():  # the gradients are spent: their memory is free for the checkpoint
            opt.zero_grad(set_to_none=True)
        return metrics, nonfinite

    def _clip(
        self, trained: list[str], per_agent: dict[str, list[TrainItem]], metrics: dict[str, dict[str, float]]
    ) -> bool:
        """Clip the `trained` policies' gradients; whether a loss or a gradient norm is non-finite (then
        no policy is updated)."""
        nonfinite = not all(math.isfinite(m["loss"]) for m in metrics.values())
        if not nonfinite:
            for name in trained:
                norm = self._clip_gradients(name)
                for agent in per_agent:
                    if self.policy_name(agent) == name:
                        metrics[agent]["grad_norm"] = norm
                nonfinite |= not math.isfinite(norm)
        return nonfinite

    def _record(self, metrics: dict, stats: dict, dropped: dict, nonfinite: bool, elapsed: float) -> None:
        """The step's bookkeeping metrics, per agent, added to `metrics`."""
        for agent, s in stats.items():
            m = metrics.setdefault(agent, {})
            m.update(
                reward_mean=s["reward_sum"] / max(1, s["samples"]),
                groups=s["groups"],
                zero_variance_groups=s["zero_variance_groups"],
                decoupled_samples=s["decoupled_samples"],
                masked_truncated_samples=s["masked_truncated_samples"],
                skipped_nonfinite=float(nonfinite),
                learning_rate=self.optimizers[self.policy_name(agent)].param_groups[0]["lr"],
            )
            if "tokens" in m:
                m["tokens_per_s"] = m["tokens"] / elapsed
            if (peak := peak_memory_gb(self.device)) is not None:
                m["peak_memory_gb"] = peak  # this rank's
        for agent, ids in dropped.items():
            metrics.setdefault(agent, {})["dropped_stale_samples"] = float(len(ids))

    def _accumulate_gradients(self, per_agent: dict[str, list[TrainItem]]) -> dict[str, dict[str, float]]:
        """Every agent's loss back-propagated (with several ranks, each its share of the samples, the
        gradients then summed over ranks); returns the agents' metrics."""
        lc = self.cfg.learner
        normalizers = loss_normalizers(per_agent, self.policy_name, lc.agent_weighting)
        totals = {}
        for agent, items in per_agent.items():  # the same agents, in the same order, on every rank
            mine, min_batches = items, 0
            if self.ranks is not None:
                sizes = [len(i.sample.prompt_tokens) + len(i.sample.token_ids) for i in items]
                groups = self.ranks.world_size // lc.sequence_parallel  # the ranks of a sequence group share
                mine = distributed.split_by_tokens(items, sizes, groups)[self.ranks.rank // lc.sequence_parallel]
                if self.sharded:  # every rank runs as many forwards and backwards (each is a collective)
                    min_batches = distributed.max_over_ranks(len(pack(mine, lc.micro_batch_tokens)))
            totals[agent] = backward(
                self.scorers[self.policy_name(agent)],
                mine,
                normalizers[agent],
                self.loss_options,
                lc,
                reference=self.reference,
                step=self.step,
                device=self.device,
                autocast=self.autocast,
                min_batches=min_batches,
                filler=items[0],
            )
        if self.ranks is not None:
            if self.sequence is not None and self.sequence.rank:  # its group's first rank counts the metrics
                totals = {agent: t | dict.fromkeys(SUMMED, 0.0) for agent, t in totals.items()}
            totals = distributed.reduce_totals(totals, SUMMED, MAXED)
            if not self.sharded:
                for name in sorted({self.policy_name(a) for a in per_agent}):
                    distributed.all_reduce_gradients(self.models[name])
        return {agent: finish_metrics(t) for agent, t in totals.items()}

    def _clip_gradients(self, name: str) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self.models[name].parameters(), self.cfg.learner.max_grad_norm)
        return float(distributed.full(norm))

    def _check_weights(self, name: str) -> None:
        """After an update: a parameter that is non-finite or past `learner.max_weight_abs` stops the run
        (`PolicyDiverged`) before the step is published. Every rank checks its shards (one device sync
        for all the per-parameter maxima)."""
        named = [(n, distributed.local(p).detach()) for n, p in self.models[name].named_parameters()]
        with torch.no_grad():
            peaks = torch.stack(
                [t.abs().amax().float() if t.numel() else t.new_zeros((), dtype=torch.float32) for _, t in named]
            )
        bound = self.cfg.learner.max_weight_abs
        bad = [(n, v) for (n, _), v in zip(named, peaks.tolist()) if not math.isfinite(v) or (bound and v > bound)]
        if self.ranks is not None and distributed.any_over_ranks(bool(bad)) and not bad:
            bad = [("(on another rank)", None)]
        if not bad:
            return
        param, peak = bad[0]
        if peak is None:
            what = f"non-finite or past learner.max_weight_abs = {bound}"
        elif math.isfinite(peak):
            what = f"{peak:.3g} in absolute value (past learner.max_weight_abs = {bound:g})"
        else:
            what = "non-finite"
        raise PolicyDiverged(
            f"learner step {self.step + 1}: the update made {name}'s parameter {param} {what}; the run stops and "
            f"this step was not published: look at learner.learning_rate ({self.cfg.learner.learning_rate:g})"
        )
