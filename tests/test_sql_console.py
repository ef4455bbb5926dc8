"""`marsrl sql` and `marsrl check` on a store whose rows live in Parquet files (as a long run and
`marsrl compact` leave it): every table and view reads, files outside the data path and every kind of
write are refused, results pipe as CSV, JSON or Markdown; the invariants print one line each."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest

from marsrl_core.agents.problems import Problem
from marsrl_core.cli import main
from marsrl_core.store import Rejection, RewardRow, SampleRow, SegmentRow, SegmentStore
from marsrl_core.store.schema import TABLES, VIEWS

RUN = "run-a"
CATALOGS = ("sqlite", "postgres")  # the read-only console on a SQLite and a PostgreSQL catalog (conftest)


@pytest.fixture
def lake(store_paths):
    """A store with rows in every table, compacted: its rows are read from Parquet files; the `--set`
    options that point `marsrl` at it."""
    store = SegmentStore(*store_paths)
    store.create_run(RUN, {"seed": 0})
    store.add_problems(RUN, [Problem(f"p{i}", "1+1", "2") for i in range(3)])
    for i in range(3):
        sid = f"s{i}"
        store.append(
            RUN,
            [SampleRow(sid, f"p{i}", "solver", 0, f"g{i}", 1, [1, 2])],
            [SegmentRow(sid, 0, [5, 6], [-0.1, -0.2], 0, "length"), SegmentRow(sid, 1, [7], [-0.3], 1, "stop")],
            [RewardRow(sid, 1.0, True, text="Answer: 2")],
        )
    store.commit_step(RUN, 1, {"solver": ["s0", "s1"]}, "ckpt/v1", metrics={"solver": {"loss": 0.5}})
    store.record_evaluation(RUN, "before", "synthetic", {"solver_acc": 0.5})
    store.mark(RUN, "batch_done:0")
    store.reject(RUN, [Rejection("train.jsonl", "line 3", "missing field 'query'")])
    store.compact(retention_s=0)
    store.close()
    assert list(Path(store_paths[1]).rglob("*.parquet"))
    return ["--set", f"store.catalog_url={store_paths[0]}", "--set", f"store.data_path={store_paths[1]}"]


def _state(tmp_path: Path, store_paths: tuple[str, str]) -> tuple:
    """What a write would change: the files of the data path, the catalog's snapshots, the row counts."""
    store = SegmentStore(*store_paths, create=False, read_only=True)
    files = sorted(str(p) for p in (tmp_path / "data").rglob("*"))
    snapshots = store.query("SELECT list(snapshot_id ORDER BY snapshot_id) AS s FROM ducklake_snapshots('lake')")
    counts = [store.count(table) for table in TABLES]
    store.close()
    return files, snapshots.to_pylist(), counts


def test_every_table_and_view_reads_from_parquet_and_aggregates_count_right(lake, capsys):
    for name in [*TABLES, *VIEWS]:
        assert main(["sql", *lake, "--format", "json", f"SELECT * FROM {name} LIMIT 1"]) == 0, name
        rows = json.loads(capsys.readouterr().out)
        if name not in ("in_flight_decodes",):  # every sample here has finished: nothing in flight
            assert len(rows) == 1, name
    counts = (
        "SELECT (SELECT count(*) FROM samples) AS samples, (SELECT count(*) FROM segments) AS segments, "
        "(SELECT count(*) FROM consumptions) AS consumptions, "
        "(SELECT sum(len(token_ids)) FROM segments) AS tokens, (SELECT avg(reward) FROM rewards) AS reward"
    )
    assert main(["sql", *lake, "--format", "json", counts]) == 0
    [row] = json.loads(capsys.readouterr().out)
    assert row == {"samples": 3, "segments": 6, "consumptions": 2, "tokens": 9, "reward": 1.0}
    assert main(["sql", *lake, "SELECT agent, count(*) AS n FROM samples GROUP BY agent"]) == 0
    assert "│ solver │ 3 │" in capsys.readouterr().out


def test_files_outside_the_data_path_and_every_write_are_refused_with_the_store_unchanged(
    lake, store_paths, tmp_path, capsys
):
    data = f"{tmp_path}/data"
    inside = f"SELECT count(*) AS n FROM read_parquet('{data}/**/*.parquet')"
    assert main(["sql", *lake, "--format", "csv", inside]) == 0
    assert int(capsys.readouterr().out.splitlines()[1]) > 0
    (tmp_path / "outside.csv").write_text("a\n1\n")
    for sql in (
        "SELECT * FROM read_parquet('/etc/passwd')",
        "SELECT * FROM read_csv('/etc/hostname')",
        f"SELECT * FROM read_csv('{tmp_path}/outside.csv')",
        f"SELECT * FROM read_csv('{data}/../outside.csv')",
        "SELECT * FROM glob('/etc/*')",
    ):
        assert main(["sql", *lake, sql]) == 2, sql
        err = capsys.readouterr().err
        assert "reads only its data path" in err and "Cannot access file" in err and len(err.splitlines()) == 1, err
    before = _state(tmp_path, store_paths)
    writes = [
        "INSERT INTO samples SELECT * FROM samples",
        "UPDATE rewards SET reward = 0",
        "DELETE FROM consumptions",
        "CREATE TABLE extra (a INT)",
        "CREATE VIEW extra AS SELECT 1",
        "DROP TABLE runs",
        "ALTER TABLE runs ADD COLUMN x INT",
        f"ATTACH 'ducklake:sqlite:{tmp_path}/lake.sqlite' AS again (DATA_PATH '{data}/')",
        f"ATTACH '{data}/new.duckdb' AS fresh",
        "DETACH lake",
        f"COPY samples TO '{data}/samples.csv'",
        f"EXPORT DATABASE '{data}/export'",
        "INSTALL httpfs",
        "LOAD httpfs",
        "SET threads = 1",
        "RESET allowed_directories",
        "PRAGMA enable_profiling",
        "CHECKPOINT",
        "VACUUM",
        "CALL ducklake_flush_inlined_data('lake')",
        "CALL ducklake_merge_adjacent_files('lake')",
        "SELECT * FROM ducklake_flush_inlined_data('lake')",
        "SELECT * FROM ducklake_merge_adjacent_files('lake')",
        "SELECT * FROM ducklake_expire_snapshots('lake', older_than => now())",
        "SELECT * FROM ducklake_cleanup_old_files('lake', cleanup_all => true)",
        "SELECT * FROM ducklake_set_option('lake', 'parquet_compression', 'zstd')",
        "SELECT * FROM query('DELETE FROM samples')",
        "EXPLAIN ANALYZE SELECT * FROM ducklake_merge_adjacent_files('lake')",
        "EXPLAIN ANALYZE DELETE FROM samples",
        "SELECT 1; DELETE FROM samples",
        "SELECT * FROM samples; DROP TABLE samples",
    ]
    for sql in writes:
        assert main(["sql", *lake, sql]) == 2, sql
        err = capsys.readouterr().err
        assert "read-only" in err and len(err.strip().splitlines()) == 1, (sql, err)
    assert _state(tmp_path, store_paths) == before


def test_results_pipe_as_csv_json_and_markdown(lake, capsys):
    sql = "SELECT sample_id, segment_index, token_ids, finish_reason FROM segments ORDER BY 1, 2"
    assert main(["sql", *lake, "--format", "csv", sql]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert len(rows) == 6 and rows[0] == {
        "sample_id": "s0",
        "segment_index": "0",
        "token_ids": "[5, 6]",
        "finish_reason": "length",
    }
    assert main(["sql", *lake, "--format", "json", sql]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 6
    assert rows[1] == {"sample_id": "s0", "segment_index": 1, "token_ids": [7], "finish_reason": "stop"}
    assert main(["sql", *lake, "--format", "json", "SELECT created_at FROM runs"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["created_at"].startswith("20")  # ISO text
    assert main(["sql", *lake, "--format", "markdown", sql]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| sample_id | segment_index | token_ids | finish_reason |" and lines[1] == "|---|---|---|---|"
    assert lines[2] == "| s0 | 0 | [5, 6] | length |" and len(lines) == 8
    with pytest.raises(SystemExit):
        main(["sql", *lake, "--format", "xml", sql])
    assert "invalid choice: 'xml'" in capsys.readouterr().err


def test_check_prints_every_invariant_and_exits_1_on_a_duplicated_segment(lake, store_paths, capsys):
    from marsrl_core.store.invariants import INVARIANTS

    assert main(["check", *lake, RUN]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(INVARIANTS) and all(line.split()[0] == "ok" and line.split()[2] == "0" for line in lines)
    assert main(["check", *lake, "no-such-run"]) == 2
    assert "no such run" in capsys.readouterr().err
    # A second row for a stored (sample_id, segment_index), written past the store's own key check, as a
    # writer without it would.
    store = SegmentStore(*store_paths)
    store._transaction(
        lambda con: con.execute("INSERT INTO lake.segments SELECT * FROM lake.segments WHERE sample_id = 's1'")
    )
    store.close()
    assert main(["check", *lake, RUN]) == 1
    broken = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("ok")]
    assert len(broken) == 1 and broken[0].split()[:3] == ["BROKEN", "segments_stored_twice", "2"]
