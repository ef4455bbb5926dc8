"""Config: presets, YAML, CLI overrides, and errors that name the field and the value."""

from __future__ import annotations

import pytest

from marsrl_core.cli import main
from marsrl_core.config import PRESETS, ConfigError, MarsRLConfig, config_to_yaml, load_config


def test_every_field_has_a_description():
    def walk(model):
        for name, info in model.model_fields.items():
            assert info.description, f"{model.__name__}.{name} has no description"
            annotation = info.annotation
            if isinstance(annotation, type) and issubclass(annotation, MarsRLConfig.__mro__[1]):
                walk(annotation)

    walk(MarsRLConfig)


def test_paper_preset_matches_the_paper():
    cfg = load_config("paper")
    r = cfg.rollout
    assert (r.num_generations, r.select_inputs, r.segment_tokens, r.max_turns) == (8, 2, 16384, 5)
    assert (r.solver_max_tokens, r.verifier_max_tokens, r.corrector_max_tokens) == (65536, 16384, 32768)
    assert cfg.learner.learning_rate == 1e-6 and r.temperature == 0.85
    assert cfg.learner.gradient_checkpointing  # 64K-token samples do not train without it
    assert cfg.learner.padding_free  # nor, at a useful speed, in padded micro-batches


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  num_generations: 4\n  segment_tokens: 16\nseed: 7\n")
    cfg = load_config("tiny", path, ["rollout.num_generations=3", "learner.policies=per_agent"])
    assert cfg.rollout.num_generations == 3 and cfg.rollout.segment_tokens == 16
    assert cfg.seed == 7 and cfg.learner.policies == "per_agent"
    # A dumped config loads back to the same values.
    again = tmp_path / "again.yaml"
    again.write_text(config_to_yaml(cfg))
    assert load_config("tiny", again) == cfg


@pytest.mark.parametrize(
    "preset, overrides, expected",
    [
        ("tiny", ["rollout.segment_tokens=500"], "segment_tokens=500"),
        ("tiny", ["rollout.num_generations=0"], "rollout.num_generations=0"),
        ("tiny", ["rollout.num_generations=1"], "rollout.num_generations=1: a GRPO group needs at least 2"),
        ("tiny", ["rollout.downstream_generations=1"], "rollout.downstream_generations=1: a GRPO group needs"),
        ("tiny", ["learner.clip_ratio_c=0.5"], "learner.clip_ratio_c=0.5"),
        ("tiny", ["learner.tis_mode=sequence"], "learner.tis_mode='sequence'"),
        ("tiny", ["engine.name=tgi"], "engine.name='tgi'"),
        ("nope", [], "preset='nope'"),
        ("tiny", ["rollout.no_such_field=1"], "rollout.no_such_field"),
        ("tiny", ["segment_tokens"], "dotted.key=value"),
    ],
)
def test_invalid_values_name_field_and_value(preset, overrides, expected):
    with pytest.raises(ConfigError) as err:
        load_config(preset, None, overrides)
    assert expected in str(err.value)


def test_bad_yaml_file_is_named(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("rollout: [unclosed\n")
    with pytest.raises(ConfigError, match="bad.yaml"):
        load_config("tiny", path)
    with pytest.raises(ConfigError, match="no such file"):
        load_config("tiny", tmp_path / "missing.yaml")


def test_numbers_are_finite_and_a_bool_is_not_a_number(capsys):
    assert main(["config", "--set", "learner.learning_rate=.inf"]) == 2
    assert "learner.learning_rate=inf: Input should be a finite number" in capsys.readouterr().err
    assert main(["config", "--set", "rollout.explore=.nan"]) == 2
    assert "rollout.explore=nan" in capsys.readouterr().err
    assert main(["config", "--set", "learner.max_steps=true"]) == 2
    assert "learner.max_steps=True: expected a number, got a bool" in capsys.readouterr().err
    assert main(["config", "--set", "learner.tis_cap=false"]) == 2  # an optional number too
    assert "learner.tis_cap=False" in capsys.readouterr().err
    # YAML reads 1e-4 as a string; it is still a number, and a real bool field still takes a bool
    assert load_config("tiny", None, ["learner.learning_rate=1e-4"]).learner.learning_rate == 1e-4
    assert load_config("tiny", None, ["rollout.synchronous=true"]).rollout.synchronous is True


def test_cli_reports_config_errors_without_traceback(capsys):
    assert main(["config", "--set", "rollout.num_generations=-1"]) == 2
    assert "rollout.num_generations=-1" in capsys.readouterr().err
    assert main(["config", "--preset", "paper"]) == 0
    assert "segment_tokens: 16384" in capsys.readouterr().out
    assert set(PRESETS) == {"tiny", "paper"}


def test_a_config_given_in_part_merges_its_fields_over_a_whole_one():
    from marsrl_core.config import MarsRLConfig, build_config, given_in_part, merged_over

    served = load_config("tiny", None, ["rollout.segment_tokens=16", "learner.learning_rate=0.002"])
    served = served.model_dump(mode="json")
    part = MarsRLConfig.model_validate({"learner": {"max_steps": 3}})  # as Prefect validates the parameter
    assert given_in_part(part) and part.rollout.segment_tokens != 16  # the class defaults fill the rest
    merged = merged_over(served, part)
    assert merged.learner.max_steps == 3 and merged.rollout.segment_tokens == 16 and merged.preset == "tiny"
    assert merged.learner.learning_rate == 0.002  # a sibling of the given field keeps its served value
    assert not given_in_part(build_config(served)) and not given_in_part(merged)


def test_a_few_dotted_overrides_change_only_those_fields_and_are_validated():
    from marsrl_core.config import with_overrides

    cfg = load_config("tiny", None, ["rollout.segment_tokens=16"])
    changed = with_overrides(cfg, {"learner.max_steps": 3, "rollout.max_turns": 2})
    assert (changed.learner.max_steps, changed.rollout.max_turns) == (3, 2)
    assert changed.rollout.segment_tokens == 16 and changed.preset == "tiny" and changed.sft == cfg.sft
    assert with_overrides(cfg, None) is cfg
    with pytest.raises(ConfigError, match="learner.max_stepz"):
        with_overrides(cfg, {"learner.max_stepz": 3})
    with pytest.raises(ConfigError, match="learner.max_steps=0"):
        with_overrides(cfg, {"learner.max_steps": 0})
