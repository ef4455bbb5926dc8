"""Evaluation metrics computed from outputs the test chooses (a scripted engine)."""

from __future__ import annotations

import math

import pytest

from marsrl_core.agents.evaluation import evaluate
from marsrl_core.agents.problems import Problem
from marsrl_core.agents.roles import TINY_TEMPLATES, Roles
from marsrl_core.engines.base import SamplingParams, TextGenerator
from tests.scripted import ScriptedEngine

BUDGET = {"solver": 64, "verifier": 64, "corrector": 64}


def test_metrics_match_a_hand_count():
    # Problem a: the solver is right; the verifier wrongly flags it; the corrector keeps it right.
    # Problem b: the solver is wrong; the verifier catches it; the corrector fixes it.
    # Problem c: the solver is wrong; the verifier misses it; the corrector breaks nothing it could.
    problems = [Problem("a", "1+1", "2"), Problem("b", "2+2", "4"), Problem("c", "3+3", "6")]
    solver = {"1+1": "Answer: 2", "2+2": "Answer: 5", "3+3": "Answer: 7"}
    verifier = {"1+1": "Correctness: Wrong", "2+2": "Correctness: Wrong", "3+3": "Correctness: Correct"}
    corrector = {"1+1": "Answer: 2", "2+2": "Answer: 4", "3+3": "Answer: 9"}

    def script(prompt):
        role, problem = prompt.split("|")[:2]
        return {"S": solver, "V": verifier, "C": corrector}[role][problem]

    engine = ScriptedEngine(script)
    gen = TextGenerator(engine, engine.tokenizer, 8, SamplingParams(temperature=0))
    report = evaluate(
        gen, Roles.from_config(base=TINY_TEMPLATES), problems, k=2, max_tokens=BUDGET, accept_after=2, max_rounds=3
    )
    assert report.solver_acc == pytest.approx(2 / 6)
    assert report.verifier_recall == pytest.approx(2 / 4)  # b caught twice, c missed twice
    assert report.verifier_precision == pytest.approx(2 / 4)  # 4 Wrong verdicts, 2 on wrong solutions
    assert report.verifier_bal_acc == pytest.approx((0.5 + 0.0) / 2)
    assert report.corrector_fix == pytest.approx(2 / 4) and report.corrector_break == 0.0
    assert report.corrector_break_false_flag == 0.0  # a: flagged while right, kept right (both samples)
    # V-C: a is flagged then "corrected" to the same right answer; b fixed; c accepted while wrong.
    assert report.vc_acc == pytest.approx(4 / 6)
    assert report.tokens_per_problem > 0
    assert report.truncated == report.unparsable == {"solver": 0, "verifier": 0, "corrector": 0}


def test_truncated_and_unparsable_outputs_are_counted_per_agent_and_reported():
    """Problem a: the Solver gives no answer, the Verifier no verdict. Problem b: the Solver runs past its
    budget; its Verifier is cut off too; the Corrector answers. k=2: every count doubles."""
    from marsrl_core.runtime.report import report_rows

    problems = [Problem("a", "1+1", "2"), Problem("b", "2+2", "4")]
    long = "x" * 100  # past the 64-token budget of the tiny character tokenizer
    texts = {
        ("S", "1+1"): "I do not know",
        ("S", "2+2"): long,
        ("V", "1+1"): "hmm",
        ("V", "2+2"): long,
        ("C", "1+1"): "no idea",
        ("C", "2+2"): "Answer: 4",
    }
    engine = ScriptedEngine(lambda prompt: texts[tuple(prompt.split("|")[:2])])
    gen = TextGenerator(engine, engine.tokenizer, 8, SamplingParams(temperature=0))
    report = evaluate(
        gen, Roles.from_config(base=TINY_TEMPLATES), problems, k=2, max_tokens=BUDGET, accept_after=1, max_rounds=1
    )
    assert report.truncated == {"solver": 2, "verifier": 2, "corrector": 0}
    assert report.unparsable == {"solver": 2, "verifier": 2, "corrector": 2}
    assert report.solver_acc == 0.0 and report.corrector_fix == pytest.approx(2 / 4)
    rows = {row[0]: row[1:] for row in report_rows({"eval": report})}
    assert rows["outputs cut by their budget: solver"] == ["2"] and rows[
        "outputs with no answer or verdict: verifier"
    ] == ["2"]
    assert "outputs cut by their budget: corrector" not in rows  # a row appears where there is a case


def test_rates_without_cases_are_nan():
    engine = ScriptedEngine(lambda p: "Answer: 2" if p[0] in "SC" else "Correctness: Correct")
    gen = TextGenerator(engine, engine.tokenizer, 8, SamplingParams(temperature=0))
    report = evaluate(
        gen, Roles.from_config(base=TINY_TEMPLATES), [Problem("a", "1+1", "2")], k=1, max_tokens=BUDGET, accept_after=1
    )
    assert report.solver_acc == 1.0 and math.isnan(report.corrector_fix) and report.vc_acc == 1.0
    assert math.isnan(report.corrector_break_false_flag)  # nothing was flagged
    from marsrl_core.runtime.report import report_rows

    rows = {row[0]: row[1] for row in report_rows({"after": report})}  # what the table prints
    assert rows["Corrector fix rate"] == "n/a" and rows["Solver accuracy"] == "100.0%"


def _eval_config(tmp_path, *overrides: str):
    """The tiny preset with its store under `tmp_path`, 2 problems, one V-C round, then `overrides`."""
    from marsrl_core.config import load_config

    where = [f"store.catalog_url=sqlite:{tmp_path}/l.sqlite", f"store.data_path={tmp_path}/d"]
    return load_config("tiny", None, [*where, "evaluation.num_problems=2", "evaluation.max_rounds=1", *overrides])


def test_per_agent_checkpoints_evaluate_each_role_with_its_own_model(tmp_path):
    """A per-agent checkpoint folder holds solver/verifier/corrector models; each role uses its own."""
    from marsrl_core.demo.tiny import build_tiny_model
    from marsrl_core.runtime.evaluate import evaluate_policy
    from marsrl_core.store import SegmentStore

    ckpt = tmp_path / "v1"
    for i, agent in enumerate(("solver", "verifier", "corrector")):
        build_tiny_model(ckpt / agent, seed=i, max_position_embeddings=512)
    cfg = _eval_config(tmp_path, "evaluation.k=1")
    store = SegmentStore.from_config(cfg.store)
    report = evaluate_policy(cfg, store, "r", "after", folder=ckpt)
    assert report.problems == 2
    with pytest.raises(Exception, match="not found or has no config.json"):
        evaluate_policy(cfg, store, "r", "after", folder=tmp_path / "empty")


def test_per_agent_generators_draw_independent_noise(tmp_path):
    """Per-agent models that are identical must still sample independently: when every generator drew the
    same noise on its first call, the Corrector repeated the Solver's mistakes (fix rate 6% measured)."""
    from marsrl_core.config import load_config
    from marsrl_core.demo.tiny import build_tiny_model
    from marsrl_core.runtime.evaluate import evaluation_generators

    for agent in ("solver", "verifier", "corrector"):
        build_tiny_model(tmp_path / "v1" / agent, seed=0, max_position_embeddings=128)  # the same weights
    generators = evaluation_generators(load_config("tiny", None, ["seed=3"]), tmp_path / "v1")
    assert len({id(g) for g in generators.values()}) == 3
    prompts = [f"S|{i}+{i}|" for i in range(8)]
    solver, corrector = (generators[a].complete(prompts, 24) for a in ("solver", "corrector"))
    assert [o.token_ids for o in solver] != [o.token_ids for o in corrector]
    shared = evaluation_generators(load_config("tiny"), tmp_path / "v1" / "solver")  # one model, one generator
    assert len({id(g) for g in shared.values()}) == 1


def test_with_no_run_in_the_store_eval_takes_the_warm_start_or_says_it_builds_a_tiny_model(tmp_path):
    from marsrl_core.config import load_config
    from marsrl_core.demo.sft import find_warm_start
    from marsrl_core.runtime.evaluate import resolve_checkpoint
    from marsrl_core.store import SegmentStore

    store = SegmentStore(f"sqlite:{tmp_path}/lake.sqlite", f"{tmp_path}/data")
    try:
        cfg = load_config("tiny")
        warm = find_warm_start(cfg)
        assert warm is not None  # the tiny preset's committed warm start
        assert resolve_checkpoint(cfg, store, None) == (warm, f"the tiny preset's warm start {warm}")
        cold = load_config("tiny", None, ["sft.enabled=false"])
        starting = "the starting policy (a tiny model built from the config)"
        assert resolve_checkpoint(cold, store, None) == (None, starting)
    finally:
        store.close()


def test_marsrl_eval_evaluates_the_checkpoint_it_is_given_and_says_which(tmp_path, capsys):
    """`--checkpoint RUN`, `RUN:VERSION` and a folder evaluate that policy; with none, the newest version
    of the store's most recent run; a run without versions is one line, exit 2."""
    from marsrl_core.cli import main
    from marsrl_core.demo.tiny import build_tiny_model
    from marsrl_core.store import SegmentStore
    from tests.configs import set_args

    folder = build_tiny_model(tmp_path / "model", hidden_size=64, num_heads=2, max_position_embeddings=256)
    args = [*set_args(tmp_path, **{"evaluation.num_problems": 1, "evaluation.k": 1, "evaluation.max_rounds": 1})]
    store = SegmentStore(f"sqlite:{tmp_path}/lake.sqlite", f"{tmp_path}/data")
    store.create_run("trained", {})
    store.commit_step("trained", 1, {}, str(folder))  # a committed version whose checkpoint is a model folder
    store.close()
    expected = {
        None: "evaluating run trained version 1 (the newest)",
        "trained": "evaluating run trained version 1 (its newest)",
        "trained:1": "evaluating run trained version 1\n",
        str(folder): f"evaluating folder {folder}",
    }
    for spec, said in expected.items():
        code = main(["eval", *args, *([] if spec is None else ["--checkpoint", spec])])
        out = capsys.readouterr().out
        assert code == 0 and said in out and "Solver accuracy" in out, out[-2000:]
    for spec, error in {"trained:2": "has no committed version 2", "nobody": "no run of that name"}.items():
        assert main(["eval", *args, "--checkpoint", spec]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: --checkpoint") and error in err and len(err.strip().splitlines()) == 1


class _Recorder:
    """A `runtime.progress.Progress` that keeps every event."""

    def __init__(self):
        self.events: list[tuple] = []

    def phase(self, label, outputs):
        self.events.append(("phase", label, outputs))

    def segment(self, segments, tokens, active):
        self.events.append(("segment", segments, tokens, active))

    def close(self):
        self.events.append(("close",))


def test_progress_sees_each_phase_and_segment_and_changes_nothing(tmp_path):
    """A real tiny model sampling at temperature 1: the report is the same with progress as without, and
    progress sees the Solver, Verifier and Corrector phases, then each V-C round, segment by segment."""
    from marsrl_core.demo.tiny import build_tiny_model
    from marsrl_core.runtime.evaluate import evaluate_policy
    from marsrl_core.runtime.progress import LogProgress
    from marsrl_core.store import SegmentStore

    build_tiny_model(tmp_path / "m", seed=0, max_position_embeddings=512)
    cfg = _eval_config(tmp_path, "evaluation.k=2", "evaluation.accept_after=1", "seed=5")
    store = SegmentStore.from_config(cfg.store)
    plain = evaluate_policy(cfg, store, "r", "plain", folder=tmp_path / "m")
    recorder = _Recorder()
    watched = evaluate_policy(cfg, store, "r", "watched", folder=tmp_path / "m", progress=recorder)
    assert repr(watched.as_dict()) == repr(plain.as_dict())  # NaN-safe equality of every measure
    phases = [e[1:] for e in recorder.events if e[0] == "phase"]
    assert phases[:3] == [("solver", 4), ("verifier", 4), ("corrector", 4)]
    assert phases[3:] == [("V-C round 1 verifier", 4)]  # one round: no Corrector call after the last verdict
    assert recorder.events[-1] == ("close",) and recorder.events.count(("close",)) == 1  # evaluate ends it
    # Within a phase: segments count up from 1, tokens never fall, and the last segment leaves none active.
    runs, current = [], None
    for event in recorder.events[:-1]:
        if event[0] == "phase":
            current = []
            runs.append(current)
        else:
            current.append(event[1:])
    for segments in runs:
        assert [s[0] for s in segments] == list(range(1, len(segments) + 1))
        assert all(a[1] <= b[1] for a, b in zip(segments, segments[1:])) and segments[-1][2] == 0
    # The Solver phase decoded exactly the Solver's tokens: tokens_per_problem counts them and the loop's.
    solver_tokens = runs[0][-1][1]
    assert 0 < solver_tokens <= watched.tokens_per_problem * watched.problems

    lines = []
    progress = LogProgress(lines.append, every_s=0.0)
    evaluate_policy(cfg, store, "r", "logged", folder=tmp_path / "m", progress=progress)  # it ends the last phase
    assert lines[0] == "evaluation solver: 4 outputs to decode"
    assert any(line.startswith("evaluation solver: done, ") and f"{solver_tokens} tokens" in line for line in lines)
    assert any("/4 finished" in line for line in lines) and lines[-1].startswith(
        "evaluation V-C round 1 verifier: done"
    )


def test_the_terminal_progress_bar_shows_each_phase():
    import io

    from rich.console import Console

    from marsrl_core.runtime.progress import BarProgress

    engine = ScriptedEngine(lambda p: "Answer: 2" if p[0] in "SC" else "Correctness: Wrong")
    gen = TextGenerator(engine, engine.tokenizer, 4, SamplingParams(temperature=0))
    screen = io.StringIO()
    with BarProgress(Console(file=screen, force_terminal=True, width=120)) as progress:
        evaluate(
            gen,
            Roles.from_config(base=TINY_TEMPLATES),
            [Problem("a", "1+1", "2")],
            k=3,
            max_tokens=BUDGET,
            accept_after=1,
            max_rounds=2,
            progress=progress,
        )
    shown = screen.getvalue()
    for label in ("solver", "verifier", "corrector", "V-C round 1 verifier", "V-C round 1 corrector", "V-C round 2"):
        assert label in shown, label
    assert "3/3" in shown and "segments" in shown and "tokens" in shown
