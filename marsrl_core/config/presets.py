"""The presets a config starts from: `paper` (the MarsRL paper's settings) and `tiny` (the CPU demo)."""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    # The MarsRL paper: Qwen3-30B-A3B-Thinking, 128 prompts x 8, 16K segments, 64K/16K/32K budgets.
    "paper": {
        "preset": "paper",
        "model": {"dtype": "bfloat16", "max_prompt_tokens": 32768},
        "engine": {"name": "vllm"},
        "rollout": {
            "num_generations": 8,
            "downstream_generations": 8,
            "select_inputs": 2,
            "max_turns": 5,
            "segment_tokens": 16384,
            "solver_max_tokens": 65536,
            "verifier_max_tokens": 16384,
            "corrector_max_tokens": 32768,
            "temperature": 0.85,
            "problems_per_batch": 128,
            # Three batches in flight keep the fleet's decode batches fuller than two: simulated at this
            # scale (`rollout/simulate.py`), 2.57x over synchronous against 2.15x with two and 2.33x with
            # four, trained samples at most 3 versions old (docs/results.md#pipeline-speed-up).
            "batches_in_flight": 3,
        },
        # Samples of up to 64K tokens: activations recomputed in backward (verl's FSDP workers' default
        # too), and padding-free rows, where a padded micro-batch of log-normal lengths is mostly padding.
        "learner": {
            "learning_rate": 1e-6,
            "policies": "shared",
            "gradient_checkpointing": True,
            "padding_free": True,
        },
        # Paper-scale reads (64 samples of up to 64K tokens) pass through the store's process: budget for them.
        "store": {"recycle_after_mb": 1024},
    },
    # CPU demo: a tiny model built from a config, short budgets, small batches.
    "tiny": {
        "preset": "tiny",
        "roles": {"templates": "tiny"},
        "sft": {"enabled": True, "max_steps": 1500},
        "evaluation": {"max_rounds": 4, "accept_after": 2, "num_problems": 512, "k": 2},
        # More batches than 50 steps need: the train flow stops starting batches once the learner has
        # its steps (about 10 in `make train`), and variants that yield fewer groups a batch (shared
        # reward, synchronous: 42 steps from 15 batches) still reach them.
        "data": {"num_batches": 20},
        "rollout": {
            "num_generations": 8,
            "downstream_generations": 4,
            "select_inputs": 2,
            "segment_tokens": 32,
            "solver_max_tokens": 96,
            "verifier_max_tokens": 96,
            "corrector_max_tokens": 96,
            "temperature": 1.0,
            "problems_per_batch": 8,
            # Half the downstream picks at random (the default is 0.25): the Verifier then sees more
            # right solutions (fewer false flags) and the Corrector more false flags, where most of its
            # breaks happen (docs/results.md; benchmarks/learning_spread.py --set rollout.explore=...).
            "explore": 0.5,
        },
        # The Verifier and Corrector take 8 groups a step (the Solver 4): a batch of 8 problems gives
        # the Solver 8 groups and each downstream agent up to 32, and with 4 a step a third of them
        # aged past max_trained_age untrained (benchmarks/learning_spread.py --set compares the two).
        "learner": {"learning_rate": 1e-4, "warmup_steps": 20, "max_steps": 50, "downstream_groups_per_step": 8},
        # Integer answers, compared exactly: checked in the rollout's thread, without a pool's round trips.
        "outcome": {"workers": 0},
    },
}
