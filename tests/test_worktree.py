"""The check that a test run leaves the working tree as it found it (see `tests/worktree.py`)."""

from __future__ import annotations

import os

from marsrl_core.runtime.tracking import artifact_location
from tests import worktree


def test_snapshot_changes_name_created_changed_and_deleted_files_and_skip_caches(tmp_path):
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "train.json").write_text("{}")
    (tmp_path / "kept.txt").write_text("a")
    (tmp_path / "gone.txt").write_text("b")
    before = worktree.snapshot(tmp_path)
    assert set(before) == {"results/train.json", "kept.txt", "gone.txt"}

    (tmp_path / "results" / "train.json").write_text('{"learner_steps": 1}')
    os.utime(tmp_path / "kept.txt", ns=(1, 1))  # same content, rewritten: still a change
    (tmp_path / "gone.txt").unlink()
    (tmp_path / "mlruns").mkdir()
    (tmp_path / "mlruns" / "meta.yaml").write_text("x")
    for cache in (".venv", "__pycache__", "marsrl.egg-info", ".pytest_cache", ".ruff_cache"):
        (tmp_path / cache).mkdir()
        (tmp_path / cache / "f").write_text("x")
    assert worktree.changes(before, worktree.snapshot(tmp_path)) == [
        "deleted gone.txt",
        "changed kept.txt",
        "created mlruns/meta.yaml",
        "changed results/train.json",
    ]


def test_the_repository_is_not_the_working_directory_of_a_test(tmp_path):
    assert os.getcwd() == str(tmp_path) and not str(tmp_path).startswith(str(worktree.ROOT))


def test_a_local_sqlite_tracking_store_keeps_its_artifacts_beside_its_database(tmp_path):
    assert artifact_location(f"sqlite:///{tmp_path}/db/mlflow.db") == (tmp_path / "db" / "mlruns").as_uri()
    assert artifact_location("sqlite:///mlflow.db") == (tmp_path / "mlruns").as_uri()  # relative to the cwd
    assert artifact_location("http://mlflow:5000") is None
