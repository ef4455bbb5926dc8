"""The learner's section of the config: the GRPO/PPO loss, the optimizer, how steps take groups,
precision and ranks.

Field names follow TRL's `GRPOConfig` where the concept is the same (`learning_rate`, `beta`,
`epsilon`, `epsilon_high`, `loss_type`, `scale_rewards`, `max_grad_norm`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from marsrl_core.config.base import AGENTS, _Section


class LearnerConfig(_Section):
    RENAMED = {"max_staleness": "max_trained_age"}
    policies: Literal["shared", "per_agent"] = Field(
        "shared",
        description="'shared': one model for all roles (the paper); 'per_agent': one model and optimizer per agent.",
    )
    learning_rate: float = Field(1e-6, gt=0, description="AdamW learning rate.")
    warmup_steps: int = Field(0, ge=0, description="Linear learning-rate warm-up steps.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    adam_epsilon: float = Field(
        1e-8,
        gt=0,
        description="AdamW's epsilon, added to the root of the second moment (TRL's and the HF Trainer's "
        "`adam_epsilon`). Larger, it damps the update of weights whose gradients are near zero.",
    )
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    max_weight_abs: float | None = Field(
        1e4,
        gt=0,
        description="A step whose update leaves a parameter non-finite or larger than this in absolute value "
        "stops the run before that version is published, in one line naming the step and the parameter (a "
        "learning rate far too large shows here, before a rollout decodes with such weights). None: only "
        "non-finite parameters stop it.",
    )
    beta: float = Field(0.0, ge=0, description="KL coefficient to the reference model (0 disables, as TRL's default).")
    epsilon: float = Field(0.2, gt=0, description="PPO clip: lower bound of the ratio is 1 - epsilon.")
    epsilon_high: float = Field(
        0.28, gt=0, description="PPO clip: upper bound of the ratio is 1 + epsilon_high (DAPO clip-higher)."
    )
    loss_type: Literal["dapo", "grpo"] = Field(
        "dapo", description="'dapo': token-level mean over the batch; 'grpo': mean per sequence, then over sequences."
    )
    scale_rewards: bool = Field(True, description="Divide advantages by the group std (False gives Dr. GRPO).")
    tis_cap: float | None = Field(
        None,
        gt=0,
        description="Truncated importance sampling (decoupled PPO) for every sample: the ratio is taken against "
        "the policy at the start of the step and each token weighted by pi_prox / pi_behaviour, capped here "
        "(None: only samples past `max_trained_age` with `stale_groups='correct'` are weighted, capped at 2).",
    )
    tis_mode: Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = Field(
        "token_truncate",
        description="How the importance weight is formed (TRL's `vllm_importance_sampling_mode`): per token or "
        "per sequence (the product of its tokens' ratios), truncated at the cap or zero above it. Per token "
        "by default: the product over a sequence thousands of tokens long collapses to 0 or past any cap.",
    )
    clip_ratio_c: float | None = Field(
        None,
        gt=1,
        description="Dual-clip PPO (verl's `clip_ratio_c`, Ye et al. 2020): for a negative advantage a token's "
        "loss is at most -A * c, so one token whose ratio has grown large cannot dominate a step (None: off).",
    )
    mask_truncated_completions: bool = Field(
        False,
        description="Leave outputs cut off by their agent's budget out of the loss (TRL's name; DAPO's overlong "
        "filtering); they still count in the group's advantages and the reward statistics. Off: they are "
        "trained on with `rollout.truncated_reward`.",
    )
    agent_weighting: Literal["sum", "mean", "token"] = Field(
        "sum",
        description="How a policy shared by several agents weighs them in one step: 'sum' adds each agent's "
        "own loss mean (the step grows with the agents in it), 'mean' averages them (each agent weighs the "
        "same), 'token' takes one mean over all their tokens (sequences for loss_type 'grpo'), so an agent "
        "weighs by its share of the tokens.",
    )
    logprob_chunk_tokens: int = Field(1024, ge=1, description="Tokens per chunk when computing log-probs and entropy.")
    micro_batch_tokens: int = Field(
        16384,
        ge=1,
        description="Token budget of one forward/backward micro-batch (one row when `padding_free`); a step's "
        "samples are cut into as few as fit, balanced in tokens (verl's dynamic batch size). With "
        "`sequence_parallel` = N each rank of a sequence group runs 1/N of it, so the budget per rank is "
        "this / N. A longer sample forms a micro-batch of its own.",
    )
    padding_free: bool = Field(
        False,
        description="One row per micro-batch: its sequences concatenated, `position_ids` restarting at 0 for "
        "each, attention confined to each sequence (FlashAttention-2's variable-length kernel with "
        "model.attn_implementation=flash_attention_2, else PyTorch's sdpa run on each sequence of the row, "
        "`learn/attention.py`). No padding token runs through the model and attention costs the sum of the "
        "squares of the sequences' lengths (TRL's `padding_free`, verl's `use_remove_padding`). Off: "
        "right-padded rows with an attention mask.",
    )
    sequence_parallel: int = Field(
        1,
        ge=1,
        description="Ulysses sequence parallelism (DeepSpeed-Ulysses; verl's `ulysses_sequence_parallel_size`): "
        "groups of this many learner ranks share each padding-free row, each running 1/N of its tokens, "
        "attention heads exchanged by all-to-all (`learn/sequence_parallel.py`). Per-rank activations "
        "shrink about N times, so one sequence may be N times longer than a rank alone holds. The ranks "
        "form a data x sequence layout (`nproc` / N data groups); needs `padding_free` and N dividing "
        "`nproc` and the model's attention heads.",
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in backward to save memory on long samples."
    )
    mixed_precision: Literal["auto", "bf16", "native"] = Field(
        "auto",
        description="'bf16': fp32 master weights and AdamW state, forward and backward under bf16 autocast "
        "(accelerate's `mixed_precision`); 'native': train and compute in `model.dtype` itself; 'auto': 'bf16' "
        "when `model.dtype` is a half type, else 'native'. Training bf16 weights directly loses updates of lr ~1e-6.",
    )
    nproc: int = Field(
        1,
        ge=1,
        description="Learner ranks on this machine (torch.distributed). Above 1, `marsrl train` runs its "
        "learner as a `marsrl learn --nproc N` process beside its rollouts (they meet through the store and "
        "the checkpoints), and `marsrl learn` starts N ranks itself.",
    )
    fsdp: bool = Field(
        False,
        description="With several learner ranks: shard parameters, gradients and optimizer state per decoder "
        "layer with FSDP2 (`fully_shard`, ZeRO-3); off, each rank holds the whole model and gradients are "
        "summed over ranks (data parallel). One process ignores it.",
    )
    fsdp_cpu_offload: bool = Field(
        False, description="FSDP2: keep parameters, gradients and optimizer state on the CPU between uses."
    )
    collective_timeout_s: float = Field(
        600.0,
        gt=0,
        description="Several learner ranks: seconds a collective waits before the step fails (a rank that "
        "died or hangs must not hang the run).",
    )
    groups_per_step: int = Field(
        4,
        ge=1,
        description="Complete groups (per agent) consumed by one learner step; a step also takes every "
        "complete group that the next step would find older than `max_trained_age`.",
    )
    downstream_groups_per_step: int | None = Field(
        None,
        ge=1,
        description="Complete groups of the Verifier and of the Corrector consumed by one learner "
        "step (None: `groups_per_step`). Per problem the Solver samples one group and each downstream turn "
        "`select_inputs` groups, so with equal counts the downstream agents produce several times what a "
        "step takes and the surplus ages past `max_trained_age`.",
    )
    max_steps: int = Field(100, ge=1, description="Learner steps in a training run.")
    max_trained_age: int | None = Field(
        4,
        ge=0,
        description="Most policy versions between a group's oldest token and the learner's current "
        "policy for the group to be trained on as it is (AReaL's max staleness eta); the rollouts admit a "
        "problem only while what is generated and not yet trained would be trained within it at the "
        "learner's pace, so a slow or late learner makes them wait instead of building a backlog. Older "
        "complete groups are handled as `stale_groups` "
        "says (corrected, or dropped untrained and recorded in the store as consumptions with learner_step "
        "-1). Past the PPO clip an uncorrected stale group gives almost no "
        "gradient, and a learner that drains a backlog oldest-first trains on ever older data. Once the "
        "rollouts have finished and no fresh group is left, stale ones are trained on rather than ending "
        "the run short of its steps. None trains on every group and lets the rollouts run ahead.",
    )
    stale_groups: Literal["drop", "correct"] = Field(
        "correct",
        description="What a step does with groups past `max_trained_age`: 'correct' them: train on them with "
        "decoupled PPO (AReaL; Hilton et al. 2022), the ratio against the policy at the start of the step and "
        "each token weighted by pi_prox / pi_behaviour, capped at `tis_cap` (2 when unset) as `tis_mode` "
        "says; or 'drop' them untrained. Over five seeds of the tiny run 'correct' drops no sample where "
        "'drop' loses 3.8%, with no measure lower (docs/results.md).",
    )
    save_every: int = Field(
        10,
        ge=1,
        description="A durable checkpoint (weights, optimizer, schedulers, RNG) every this many steps and at "
        "the end of a run (verl's `save_freq`, TRL's `save_steps`). Every step still commits a version whose "
        "weights the engines load: the steps between write the weights alone (no optimizer state, no fsync). "
        "A resume restarts from the last durable version and voids the committed steps after it "
        "(`SegmentStore.rollback_to`), so their samples are trained again, once. At 7B a durable checkpoint "
        "is ~85 GB and a weights-only one ~15 GB (bf16).",
    )
    async_save: bool = Field(
        True,
        description="Write a durable checkpoint's trainer state in a background thread (as Megatron's and "
        "verl's `async_save`): the step commits its version with the weights alone and goes on; the thread "
        "adds the optimizer state and RNG and makes the folder durable, and the next optimizer update waits "
        "for it (the tensors it writes are the live ones, not copies). A crash before it ends leaves the "
        "version weights-only, so a resume voids it. A sharded (`fsdp`) learner writes synchronously.",
    )
    save_total_limit: int | None = Field(
        3,
        ge=1,
        description="Newest durable checkpoints kept on disk (older ones, and weights-only versions older "
        "than the newest durable one, are deleted after each commit; None keeps all). Nothing needs an "
        "older one: engines load only the newest committed version, a resume the last durable one, an "
        "in-flight sample carries its own log-probs, and the MLflow registry's alias points at its own copy "
        "(`tracking.log_checkpoint_steps`). Every version stays a row in the store.",
    )

    @model_validator(mode="after")
    def _sequence_parallel_layout(self) -> LearnerConfig:
        sp = self.sequence_parallel
        if sp > 1 and not self.padding_free:
            raise ValueError(f"sequence_parallel={sp} cuts padding-free rows: set learner.padding_free=true")
        if sp > 1 and self.nproc > 1 and self.nproc % sp:
            raise ValueError(f"sequence_parallel={sp} must divide nproc={self.nproc} (data x sequence ranks)")
        return self

    def groups_per_step_by_agent(self) -> dict[str, int]:
        """Complete groups one step consumes, per agent."""
        downstream = self.downstream_groups_per_step or self.groups_per_step
        return {agent: self.groups_per_step if agent == "solver" else downstream for agent in AGENTS}
