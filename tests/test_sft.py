"""SFT warm start: the demonstrations are right where they claim to be, SFT learns, the cache works."""

from __future__ import annotations

import random

from marsrl_core.agents.roles import TINY_TEMPLATES, Roles, parse_bug_report
from marsrl_core.config import load_config
from marsrl_core.demo.synthetic import (
    correct_solution,
    demonstrations,
    keep_first_mistake,
    make_problems,
    misreport,
    noisy_steps,
    parse_steps,
    verifier_report,
)


def test_verifier_reports_mark_each_step_and_the_verdict():
    assert verifier_report("7+5=2;2+9=1;1+3=4;Answer: 4", "7+5+9+3") == (
        "7+5=2>2 ok;2+9=1>1 ok;1+3=4>4 ok;Correctness: Correct"
    )
    # The report stops at the first wrong step, as a bug report cites the first error.
    assert verifier_report("7+5=2;2+9=2;2+3=5;Answer: 5", "7+5+9+3") == "7+5=2>2 ok;2+9=2>1 no;Correctness: Wrong"
    assert verifier_report("7+5=2;2+9=1;1+3=4;Answer: 5", "7+5+9+3") == (  # answer not the last total
        "7+5=2>2 ok;2+9=1>1 ok;1+3=4>4 ok;end no;Correctness: Wrong"
    )
    assert verifier_report("7+5=2;2+9=1;Answer: 1", "7+5+9+3").endswith("end no;Correctness: Wrong")  # a step missing
    assert keep_first_mistake("7+5=2;2+9=3;3+3=4;Answer: 4", "7+5+9+3") == "7+5=2;2+9=3;3+3=6;Answer: 6"
    assert verifier_report("7+5=", "7+5+9+3") == "bad;Correctness: Wrong"
    assert parse_steps(correct_solution("1+2+3")) == [(1, 2, 3), (3, 3, 6)]


def test_misreports_flag_a_step_with_a_wrong_recomputed_total():
    rng = random.Random(0)
    for _ in range(50):
        # A right solution: one step that holds is flagged, the steps before it marked ok.
        report = misreport("7+5=2;2+9=1;1+3=4;Answer: 4", "7+5+9+3", rng)
        marks = report.removesuffix(";Correctness: Wrong").split(";")
        assert all(m.endswith(" ok") and m.split(">")[0].split("=")[1] == m.split(">")[1][0] for m in marks[:-1])
        step, total = marks[-1].removesuffix(" no").split(">")
        a, b = map(int, step.split("=")[0].split("+"))
        assert step in ("7+5=2", "2+9=1", "1+3=4") and int(total) != (a + b) % 10
        # A wrong solution: its first wrong step is flagged with neither its own nor the right total.
        report = misreport("7+5=2;2+9=2;2+3=5;Answer: 5", "7+5+9+3", rng)
        assert report.startswith("7+5=2>2 ok;2+9=2>") and report.endswith(" no;Correctness: Wrong")
        assert report.split(";")[1][6] not in "21"
    assert misreport("7+5=", "7+5+9+3", rng) == verifier_report("7+5=", "7+5+9+3")


def test_demonstrations_inject_mistakes_at_the_configured_rates():
    rng = random.Random(0)
    problems = make_problems(2000, 0)
    demos = demonstrations(
        problems, rng, solver_error=0.15, verdict_flip=0.1, repair_failure=0.2, report_corruption=0.3
    )
    solver = [t for r, f, t in demos if r == "solver"]
    wrong = sum(t != correct_solution(p.prompt) for t, p in zip(solver, problems)) / len(problems)
    assert 0.2 < wrong < 0.5  # 15% per step over 2-4 steps
    verifier = [(f, t) for r, f, t in demos if r == "verifier"]
    flipped = sum(verifier_report(f.split("|")[1], f.split("|")[0]) != t for f, t in verifier) / len(verifier)
    assert 0.07 < flipped < 0.13
    repairs = [(f.split("|"), t) for r, f, t in demos if r == "corrector"]
    right_inputs = [(p, t) for (p, prev, _), t in repairs if prev == correct_solution(p)]
    assert 0.2 < len(right_inputs) / len(repairs) < 0.5
    assert all(t == correct_solution(p) for p, t in right_inputs)  # a right solution is kept as it is
    wrong_inputs = [(p, prev, t) for (p, prev, _), t in repairs if prev != correct_solution(p)]
    failed = [t for p, prev, t in wrong_inputs if t != correct_solution(p)]
    assert 0.15 < len(failed) / len(wrong_inputs) < 0.25  # only wrong solutions get failed repairs
    assert all(t == keep_first_mistake(prev, p) for p, prev, t in wrong_inputs if t != correct_solution(p))
    # The Corrector's report is the bug report as the rollout passes it: the verdict line removed.
    assert all("Correctness" not in f[2] for f, _ in repairs)
    # About 30% of the reports are misreported; the targets do not depend on it.
    misreported = [f[2] != parse_bug_report(verifier_report(f[1], f[0])) for f, _ in repairs]
    assert 0.25 < sum(misreported) / len(repairs) < 0.35
    assert all(f[2].rstrip(";").endswith(" no") for (f, _), bad in zip(repairs, misreported) if bad)
    assert noisy_steps("1+2+3", random.Random(1), 0.0) == [(1, 2, 3), (3, 3, 6)]


def test_sft_learns_a_small_task_and_warm_starts_are_cached(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from marsrl_core.demo.sft import train_sft, warm_start
    from marsrl_core.engines.base import SamplingParams, TextGenerator
    from marsrl_core.engines.hf import HFEngine

    cfg = load_config("tiny", None, [f"output_dir={tmp_path}/out"])
    from marsrl_core.policy import policy_folder, roles_from_config

    start = policy_folder(cfg)
    model, tok = AutoModelForCausalLM.from_pretrained(start), AutoTokenizer.from_pretrained(start)
    roles = Roles.from_config(base=TINY_TEMPLATES)
    # A task a tiny model learns in seconds: the solver always writes the first term as its answer.
    examples = [("solver", p.prompt, f"Answer: {p.prompt[0]}") for p in make_problems(300, 3)]

    def accuracy():
        engine = HFEngine(model, tok)
        gen = TextGenerator(engine, tok, 16, SamplingParams(temperature=0))
        probes = make_problems(40, 99)
        outs = gen.complete([roles.prompt(tok, "solver", p.prompt) for p in probes], 16)
        return sum(o.text.strip() == f"Answer: {p.prompt[0]}" for o, p in zip(outs, probes)) / len(probes)

    before = accuracy()
    losses = train_sft(model, tok, roles, examples, steps=150, batch_size=32, learning_rate=3e-3, seed=0)
    after = accuracy()
    assert before == 0.0 and after >= 0.8, (before, after)
    assert losses[-1] < losses[0] / 4

    cfg = load_config(
        "tiny",
        None,
        [f"output_dir={tmp_path}/out", "sft.max_steps=3", "sft.per_device_train_batch_size=4", "sft.num_problems=20"],
    )

    def start(c):
        return warm_start(c, policy_folder(c), roles_from_config(c))

    first = start(cfg)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    again = start(cfg)
    assert again == first and (again / "model.safetensors").stat().st_mtime_ns == stamp  # reused, not retrained
    other = start(cfg.model_copy(update={"seed": 1}))
    assert other != first  # a different config gets its own warm start


def test_the_committed_warm_start_is_the_tiny_presets():
    """`make train` on a fresh machine skips the SFT only if the committed folder's key matches the preset
    (changing the model, roles, task, SFT settings or demonstrations needs `marsrl sft --set
    output_dir=demo/warm-starts` again)."""
    from marsrl_core.demo.sft import COMMITTED, _key

    folder = COMMITTED / f"warm-start-{_key(load_config('tiny'))}"
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    assert (folder / "model.safetensors").stat().st_size < 5 * 2**20
