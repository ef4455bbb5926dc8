"""The config's sections: one pydantic model per part of a run, a description on every field; the
learner's is in `learner.py`, the base they share in `base.py`.

Field names follow TRL's `GRPOConfig` where the concept is the same (`num_generations`, and the
learner's `learning_rate`, `beta`, `epsilon`, ...).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from marsrl_core.config.base import AGENTS, ConfigError, _Section  # noqa: F401 (ConfigError: re-exported)
from marsrl_core.config.learner import LearnerConfig
from marsrl_core.config.outcome import OutcomeConfig


class ModelConfig(_Section):
    path: str | None = Field(
        None, description="Local Hugging Face model folder. None builds the tiny model from the fields below."
    )
    tiny_hidden_size: int = Field(128, ge=8, description="Tiny model: hidden size.")
    tiny_num_layers: int = Field(2, ge=1, description="Tiny model: number of transformer layers.")
    tiny_num_heads: int = Field(4, ge=1, description="Tiny model: attention heads (head_dim must be >= 32 for vLLM).")
    tiny_max_position_embeddings: int = Field(
        1024, ge=16, description="Tiny model: context length in tokens (prompt + response)."
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description="The dtype the engines load and the checkpoints are written in. The learner trains fp32 "
        "master weights under `learner.mixed_precision`.",
    )
    device: str = Field(
        "auto",
        pattern=r"^(auto|cpu|cuda|cuda:\d+)$",
        description="Where the learner's models and the `hf` engine run: 'auto' (cuda:<LOCAL_RANK> when CUDA "
        "is present, else the CPU), 'cpu', 'cuda' or 'cuda:N'. vLLM places itself.",
    )
    attn_implementation: Literal["auto", "sdpa", "flash_attention_2", "eager"] = Field(
        "auto",
        description="transformers attention kernel for the learner and the `hf` engine ('auto': "
        "FlashAttention-2 on CUDA when `flash_attn` is installed, else PyTorch's sdpa).",
    )
    max_prompt_tokens: int = Field(
        512, ge=1, description="Longest prompt accepted; longer dataset rows are rejected (recorded, not loaded)."
    )


class EngineConfig(_Section):
    name: Literal["hf", "vllm", "openai"] = Field(
        "hf", description="Generation engine: 'hf' (transformers, CPU default), 'vllm' (in-process), 'openai' (server)."
    )
    base_url: str | None = Field(
        None, description="OpenAI-compatible server URL (engine 'openai'), e.g. http://host:8000/v1."
    )
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1, description="vLLM: fraction of accelerator memory to use.")
    tensor_parallel_size: int = Field(1, ge=1, description="vLLM: tensor-parallel degree.")
    weight_sync: Literal["auto", "memory", "checkpoint"] = Field(
        "auto",
        description="How an 'hf' or 'vllm' engine in the learner's process (`marsrl train` with learner.nproc=1) "
        "gets each committed version: 'memory' copies the learner's weights (in model.dtype, on its device) "
        "straight into it, as verl's and TRL's colocated engines do; 'checkpoint' reloads the version's folder, "
        "which the learner writes anyway; 'auto' is 'memory' on an accelerator and 'checkpoint' on the CPU, where "
        "the copy costs more than the reload (benchmarks/weight_sync.py). Engines in other processes, a 'vllm' "
        "engine with tensor_parallel_size > 1 (its workers are processes of their own), and the 'openai' engine "
        "always reload the folder.",
    )

    kv_cache_mb: float = Field(
        256,
        ge=0,
        description="'hf' engine: memory for the keys and values of unfinished samples, kept from one segment to "
        "the next so that a sample's next segment starts without re-encoding its prompt and prefix; the rows "
        "of a segment batch that share a prompt (a group) are encoded once. Loading new weights empties it, so "
        "what is decoded is what a fresh prefill would decode (marsrl_core/engines/kv_cache.py). 0 turns it "
        "off. vLLM keeps its own prefix cache.",
    )

    @model_validator(mode="after")
    def _memory_sync_in_process(self) -> EngineConfig:
        if self.weight_sync == "memory" and self.name == "vllm" and self.tensor_parallel_size > 1:
            raise ValueError(
                f"weight_sync='memory' with tensor_parallel_size={self.tensor_parallel_size}: vLLM's tensor-parallel "
                "workers are processes of their own and cannot take the learner's tensors; use 'checkpoint' or 'auto'"
            )
        return self


class RolloutConfig(_Section):
    RENAMED = {"max_staleness": "max_version_span"}
    num_generations: int = Field(
        8, description="Solver samples per problem (the GRPO group size for the Solver; at least 2)."
    )
    downstream_generations: int = Field(
        8,
        description="Samples per selected input for the Verifier and Corrector (their GRPO group size; at least 2).",
    )
    select_inputs: int = Field(2, ge=1, description="Upstream outputs each downstream agent selects per problem.")
    selection: Literal["adaptive", "balanced", "random"] = Field(
        "adaptive",
        description="How downstream agents pick their inputs (paper ablation: adaptive > balanced > random).",
    )
    explore: float = Field(0.25, ge=0, le=1, description="Adaptive selection: fraction of picks made at random.")
    max_turns: int = Field(
        5, ge=1, le=5, description="Agent turns per trajectory: Solver, Verifier, Corrector, Verifier, Corrector."
    )
    segment_tokens: int = Field(16384, ge=1, description="Tokens decoded per segment before an output is handed back.")
    solver_max_tokens: int = Field(65536, ge=1, description="Solver response budget in tokens.")
    verifier_max_tokens: int = Field(16384, ge=1, description="Verifier response budget in tokens.")
    corrector_max_tokens: int = Field(32768, ge=1, description="Corrector response budget in tokens.")
    temperature: float = Field(0.85, ge=0, description="Sampling temperature for training rollouts.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling threshold.")
    top_k: int = Field(0, ge=0, description="Top-k sampling (0 disables).")
    max_version_span: int = Field(
        2,
        ge=0,
        description="Most policy versions one sample's segments may span; a newer version waits at the "
        "stage boundary (and no problem is admitted) until the samples that would exceed it have finished.",
    )
    problems_per_batch: int = Field(128, ge=1, description="Problems admitted per rollout batch.")
    batches_in_flight: int = Field(
        2,
        ge=1,
        description="Pipelined mode: problem batches decoding at once (batch k's Verifiers beside batch "
        "k+1's Solvers); the synchronous baseline always uses 1.",
    )
    reward_mode: Literal["decoupled", "shared"] = Field(
        "decoupled",
        description="'decoupled': each agent rewarded for its own job; 'shared': every turn gets the final outcome.",
    )
    truncated_reward: float = Field(0.0, description="Reward given to an output cut off by its agent's budget.")
    synchronous: bool = Field(False, description="Baseline: decode whole trajectories before the learner sees any.")

    def max_tokens(self, agent: str) -> int:
        """The response budget of `agent`."""
        return getattr(self, f"{agent}_max_tokens")

    @field_validator("num_generations", "downstream_generations")
    @classmethod
    def _a_group_has_two_samples(cls, value: int) -> int:
        if value < 2:
            raise ValueError(
                "a GRPO group needs at least 2 samples; a group of one has no reward variance, so it is dropped "
                "and its agent would never train"
            )
        return value

    @model_validator(mode="after")
    def _segment_within_budgets(self) -> RolloutConfig:
        for agent in AGENTS:
            budget = self.max_tokens(agent)
            if self.segment_tokens > budget:
                raise ValueError(
                    f"segment_tokens={self.segment_tokens} is longer than {agent}_max_tokens={budget}; "
                    "a segment must fit inside every agent's budget"
                )
        return self


class _DatasetFields(_Section):
    """A dataset file's field names and its rows' default verifier (training and evaluation sets alike)."""

    question_field: str = Field("query", description="Dataset field holding the problem text.")
    answer_field: str = Field("ans_box", description="Dataset field holding the reference answer.")
    verifier: Literal["math", "code"] = Field(
        "math",
        description="How a row's final outputs are checked when the row names none (its 'verifier' field): "
        "'math' (the final answer against the reference, math-verify) or 'code' (the last fenced Python "
        "block against the row's tests, in the sandbox; README, 'Datasets').",
    )


class DataConfig(_DatasetFields):
    train_dataset: str | None = Field(
        None, description="Training problems (jsonl/parquet/saved dataset); None generates the synthetic demo task."
    )
    synthetic_min_terms: int = Field(3, ge=2, description="Synthetic task: fewest terms in a chain.")
    synthetic_max_terms: int = Field(5, ge=2, description="Synthetic task: most terms in a chain.")
    verifier: Literal["math", "code"] = Field(
        "math",
        description="How a row's final outputs are checked when the row names none (its 'verifier' field): "
        "'math' (the final answer against the reference, math-verify) or 'code' (the last fenced Python "
        "block against the row's tests, in the sandbox; README, 'Datasets'). With the synthetic task, 'code' "
        "asks for its answer as a one-line Python function run against the problem's test (demo/synthetic.py), "
        "in training and in the held-out evaluation.",
    )
    num_batches: int = Field(4, ge=1, description="Problem batches (rollout flows) in a training run.")


class RolesConfig(_Section):
    templates: Literal["default", "code", "tiny"] = Field(
        "default",
        description="Base prompt templates: 'default' (the public V-C pipeline, math), 'code' (the same for "
        "programming tasks: the answer is a fenced Python block) or 'tiny' (the demo model).",
    )
    solver: str | None = Field(None, description="Solver template override (inline, or @file); fields {problem}.")
    verifier: str | None = Field(None, description="Verifier template override; fields {problem}, {solution}.")
    corrector: str | None = Field(
        None, description="Corrector template override; fields {problem}, {solution}, {report}."
    )


class SFTConfig(_Section):
    enabled: bool = Field(
        False,
        description="Warm-start the policy by supervised fine-tuning on synthetic demonstrations of all three "
        "roles before RL (the tiny preset turns it on; it applies when model.path is unset).",
    )
    max_steps: int = Field(3000, ge=1, description="SFT optimizer steps.")
    per_device_train_batch_size: int = Field(64, ge=1, description="Demonstrations per SFT step.")
    learning_rate: float = Field(
        1e-3,
        gt=0,
        description="SFT AdamW learning rate (constant after a 5% linear warm-up).",
    )
    num_problems: int = Field(4000, ge=1, description="Synthetic problems the demonstrations are made from (3 each).")
    solver_error: float = Field(0.15, ge=0, le=1, description="Solver demonstrations: chance that each step is wrong.")
    verdict_flip: float = Field(
        0.25,
        ge=0,
        le=1,
        description="Verifier demonstrations: chance that the verdict is flipped (a warm-start "
        "Verifier that sometimes contradicts its own step marks, for RL to sharpen).",
    )
    repair_failure: float = Field(
        0.4,
        ge=0,
        le=1,
        description="Corrector demonstrations: chance that the repair of a wrong solution trusts its "
        "first wrong total (and is wrong again).",
    )
    report_corruption: float = Field(
        0.25,
        ge=0,
        le=1,
        description="Corrector demonstrations: chance that the report's flagged step carries a wrong "
        "recomputed total (on a right solution, a false flag); the target is unchanged, so the Corrector learns to "
        "recompute a flagged step rather than copy the report's total.",
    )


class EvaluationConfig(_DatasetFields):
    k: int = Field(4, ge=1, description="Samples (and V-C workers) per problem: accuracies are avg@k.")
    num_problems: int = Field(64, ge=1, description="Held-out problems evaluated (the first N of the dataset).")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature during evaluation.")
    accept_after: int = Field(4, ge=1, description="V-C loop: consecutive Correct verdicts that accept a solution.")
    max_rounds: int = Field(10, ge=1, description="V-C loop: most verification rounds per worker.")
    dataset: str | None = Field(
        None, description="Benchmark file (jsonl/parquet/saved dataset); None uses held-out synthetic problems."
    )


class StoreConfig(_Section):
    catalog_url: str = Field(
        "sqlite:marsrl/lake.sqlite",
        description="DuckLake catalog: 'sqlite:<file>' locally, 'postgres:<dsn>' for a cluster.",
    )
    data_path: str = Field(
        "marsrl/lake_data/", description="Where DuckLake writes Parquet files (a folder or s3:// URL)."
    )
    compact_every_steps: int = Field(
        100,
        ge=0,
        description="The learner flow compacts the store every n policy versions: merges the small "
        "Parquet files each commit writes and expires old snapshots, so the learner's poll, which reads the "
        "whole run, stays as fast late in a run as early (0 never; `marsrl compact` and the maintenance "
        "deployment do the same on demand).",
    )
    compaction_retention_minutes: float = Field(
        10.0,
        ge=0,
        description="Compaction keeps snapshots, and the files only they or a merge replaced, for "
        "this long, so a query planned before it (a rollout, the learner, a user's SQL session) still finds "
        "its files; 0 deletes them at once, safe only when nothing else is reading the store.",
    )
    threads: int | None = Field(
        1,
        ge=1,
        description="DuckDB threads of each store connection of a training process (None: one per core; the "
        "SQL console always uses every core). The store's calls are many small queries and commits, and a "
        "second thread per call costs more CPU than it saves beside the decode and the learner "
        "(`benchmarks/step_profile.py --compare --baseline store.threads=2`).",
    )
    recent_samples_mb: float = Field(
        1024.0,
        ge=0,
        description="Memory for the samples this process stored and no learner step has consumed yet: a "
        "learner in the same process loads them from here instead of reading them back from the store "
        "(`store/recent.py`; the oldest are dropped past this size and read from the store). 0 keeps none.",
    )
    separate_process: bool = Field(
        True,
        description="Training processes (rollout, learner, train) run the store's DuckDB connection in a "
        "child process: DuckDB keeps a little native memory per query and per commit for as long as the "
        "process lives, so a days-long run's processes would otherwise grow without bound "
        "(`marsrl_core/store/process.py`). False keeps the connection in the process.",
    )
    recycle_after_mb: float = Field(
        64.0,
        gt=0,
        description="With `separate_process`, the store's child process is replaced (between calls; "
        "the replacement starts at once) when its resident memory has grown this many MB past what it had after "
        "its first 100 calls. Bounds the store's memory; a replacement costs about a second of a background "
        "start.",
    )


class TrackingConfig(_Section):
    mlflow_tracking_uri: str = Field(
        "sqlite:///mlflow.db",
        description="MLflow tracking store; the MLFLOW_TRACKING_URI environment variable overrides it.",
    )
    experiment_name: str = Field("marsrl", description="MLflow experiment.")
    registered_model_name: str = Field("marsrl-policy", description="Registered model holding the newest policy alias.")
    log_checkpoint_steps: int = Field(
        50,
        ge=0,
        description="Log a durable checkpoint (`learner.save_every`) to MLflow (artifacts and a "
        "registered-model version) once n versions have passed since the last one logged, and the newest "
        "durable one at the end of the run; 0 never. Each is a full copy of the weights, so a long run logs "
        "a few, not every step.",
    )


class MarsRLConfig(_Section):
    preset: str = Field(
        "tiny",
        description="The preset these values started from (a record: changing it changes no other field; "
        "start from another preset with `marsrl serve --preset` or `--preset`).",
        json_schema_extra={"readOnly": True},
    )
    run_name: str = Field("marsrl", description="Name of the run (store rows and MLflow run).")
    seed: int = Field(0, description="Global random seed.")
    output_dir: str = Field("marsrl", description="Folder for checkpoints, caches and the default store.")
    malloc_trim_every_s: float | None = Field(
        60.0,
        gt=0,
        description="Seconds between returns of the C allocator's free memory to the OS in a worker process "
        "(rollout, learner, train: glibc's malloc_trim from a background thread, see marsrl_core/runtime/memory.py); "
        "None disables.",
    )
    model: ModelConfig = Field(default_factory=ModelConfig, description="The policy model.")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="The generation engine.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Grouped agentic rollouts and segments.")
    learner: LearnerConfig = Field(default_factory=LearnerConfig, description="The RL learner.")
    data: DataConfig = Field(default_factory=DataConfig, description="Training problems.")
    roles: RolesConfig = Field(default_factory=RolesConfig, description="Prompt templates of the three agents.")
    sft: SFTConfig = Field(default_factory=SFTConfig, description="The supervised warm start before RL.")
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig, description="Evaluation and the V-C loop.")
    outcome: OutcomeConfig = Field(
        default_factory=OutcomeConfig, description="Checking final outputs: the worker pool and the code sandbox."
    )
    store: StoreConfig = Field(default_factory=StoreConfig, description="The DuckLake segment store.")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig, description="MLflow tracking.")

    @model_validator(mode="after")
    def _ranks_need_a_pipelined_run(self) -> MarsRLConfig:
        if self.learner.nproc > 1 and self.rollout.synchronous:
            raise ValueError(
                f"learner.nproc={self.learner.nproc} needs the pipelined run: rollout.synchronous trains in the "
                "rollouts' process, between batches"
            )
        return self
