"""The real-model path with Qwen3's real tokenizer and chat template and a random-init Qwen3
(`tests/qwen3.py`): templates, answer parsing, `marsrl eval` on AIME 2025, and a learner step over the
real 151,936-token vocabulary. `marsrl train` on it is in test_flows (Prefect) and, with vLLM, in
test_engines_vllm."""

from __future__ import annotations

import json

import pytest
import torch

from marsrl_core.agents.roles import CORRECTOR, SOLVER, VERIFIER, WRONG, Roles, parse_verdict
from tests.qwen3 import build_qwen3, qwen3_tokenizer_files
from tests.test_problems import _aime

BUDGETS = [
    "rollout.segment_tokens=8",
    "rollout.solver_max_tokens=24",
    "rollout.verifier_max_tokens=16",
    "rollout.corrector_max_tokens=16",
]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return build_qwen3(tmp_path_factory.mktemp("qwen3") / "model")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen3_tokenizer_files(tmp_path_factory.mktemp("qwen3-tokenizer")))


def test_the_chat_template_wraps_every_agents_prompt(tokenizer):
    roles = Roles.from_config()  # the default (paper) templates
    problem = "Find the sum of all integer bases $b>9$ for which $17_b$ is a divisor of $97_b$."
    for role, fields in ((SOLVER, ()), (VERIFIER, ("a solution",)), (CORRECTOR, ("a solution", "a bug report"))):
        prompt = roles.prompt(tokenizer, role, problem, *fields)
        assert prompt.startswith("<|im_start|>user\n") and prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
        assert problem in prompt and all(field in prompt for field in fields), role
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>") == 151644  # one special token, not text


def test_boxed_answers_and_verdicts_after_a_think_block_survive_the_real_tokenizer(tokenizer):
    from marsrl_core.agents.rewards import judge_solution

    solution = "<think>\nMaybe \\boxed{5}? No: 17_b = b+7 divides 9b+7.\n</think>\n\nThe sum is \\boxed{70}."
    report = "<think>\nCorrectness: Correct? Check step 2.\n</think>\nStep 2 is off.\nCorrectness: Wrong"
    for text, check in (
        (solution, lambda t: judge_solution(t, "70").correct),
        (report, lambda t: parse_verdict(t) == WRONG),
    ):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.convert_tokens_to_ids("<think>") in ids  # Qwen3's own thinking token
        decoded = tokenizer.decode(ids, skip_special_tokens=True)  # as the engines decode an output
        assert check(decoded), decoded
    assert judge_solution(solution, "5").correct is False  # the box inside the thinking does not count


def test_marsrl_eval_on_aime_with_a_random_qwen3_counts_its_truncated_outputs(qwen3, tmp_path, capsys):
    from marsrl_core.cli import main
    from marsrl_core.store import SegmentStore
    from tests.configs import set_args

    args = set_args(
        tmp_path,
        **{
            "model.path": qwen3,
            "evaluation.dataset": _aime(),
            "evaluation.num_problems": 2,
            "evaluation.k": 2,
            "evaluation.max_rounds": 1,
        },
    )
    assert main(["eval", *args, *[a for b in BUDGETS for a in ("--set", b)]]) == 0
    out = capsys.readouterr().out
    assert "outputs cut by their budget: solver" in out
    store = SegmentStore(f"sqlite:{tmp_path}/lake.sqlite", f"{tmp_path}/data")
    [row] = store.query("SELECT metrics_json, dataset FROM evaluations").to_pylist()
    metrics = json.loads(row["metrics_json"])
    assert row["dataset"] == str(_aime()) and metrics["problems"] == 2
    # Random weights over 151,936 tokens almost never sample <|im_end|>: every output runs to its budget.
    assert metrics["truncated_solver"] == 4 and metrics["solver_acc"] == 0.0


def test_a_learner_step_over_the_real_vocabulary_is_on_policy_and_masks_a_truncated_output(qwen3, tmp_path):
    """hf-engine samples of a chat-templated AIME prompt, rewarded by a rule with variance; one step. The
    learner's chunked log-probs over 151,936 rows match the engine's (ratio 1), and with
    mask_truncated_completions every budget-cut output is left out of the loss."""
    from marsrl_core.config import load_config
    from marsrl_core.engines.hf import HFEngine
    from marsrl_core.learn.learner import Learner
    from marsrl_core.store import SegmentStore
    from tests.rollout_helpers import sample_groups

    cfg = load_config(
        "tiny",
        None,
        [
            f"store.catalog_url=sqlite:{tmp_path}/lake.sqlite",
            f"store.data_path={tmp_path}/d",
            "learner.warmup_steps=0",
            "learner.learning_rate=1e-3",
        ],
    )
    store = SegmentStore.from_config(cfg.store)
    engine = HFEngine.from_pretrained(qwen3)
    learner = Learner(cfg, store, "q", qwen3, tmp_path / "ckpt", engine.tokenizer)
    problem = json.loads(open(_aime()).readline())["query"]
    prompt = Roles.from_config().prompt(engine.tokenizer, SOLVER, problem)
    even = lambda ids, tokenizer: sum(t % 2 == 0 for t in ids) / max(1, len(ids))  # noqa: E731
    groups = sample_groups(engine, store, "q", "solver", prompt, groups=2, size=4, reward_fn=even, max_tokens=12)
    before = {k: v.clone() for k, v in learner.models["policy"].state_dict().items()}
    m = learner.train_step(groups).metrics["solver"]
    assert abs(m["ratio_mean"] - 1.0) < 1e-4 and m["tokens"] == 2 * 4 * 12 and m["loss"] == m["loss"]
    after = learner.models["policy"].state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the step changed the weights

    masked = cfg.model_copy(update={"learner": cfg.learner.model_copy(update={"mask_truncated_completions": True})})
    learner = Learner(masked, store, "q2", qwen3, tmp_path / "ckpt2", engine.tokenizer)
    groups = sample_groups(engine, store, "q2", "solver", prompt, groups=2, size=4, reward_fn=even, max_tokens=12)
    before = {k: v.clone() for k, v in learner.models["policy"].state_dict().items()}
    m = learner.train_step(groups).metrics["solver"]
    # All eight ran out of their budget: none is in the loss, so nothing is trained; the rewards still count.
    assert m["masked_truncated_samples"] == 8 and "loss" not in m and m["reward_mean"] > 0
    after = learner.models["policy"].state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
