"""The segment store's schema: append-only event tables and the views users query.

Every fact is a new row; state (which samples are finished, which groups are trainable, what is in
flight) is derived by queries. DuckLake has no primary keys or row locks, so nothing is ever
updated: appends from any number of processes never conflict logically.

Deliberate simplifications: ids are strings (uuids) so that processes can mint them without
coordination; timestamps are the committing transaction's clock (`current_timestamp`).
"""

from __future__ import annotations

import pyarrow as pa

TIMESTAMP = pa.timestamp("us", tz="UTC")

# Arrow schemas of the tables written in bulk. The DDL below is derived from them so the two never
# drift apart; `created_at` is filled in by the database at commit.
ARROW_SCHEMAS: dict[str, pa.Schema] = {
    "runs": pa.schema([("run_id", pa.string()), ("config_json", pa.string())]),
    "problems": pa.schema(
        [
            ("run_id", pa.string()),
            ("problem_id", pa.string()),
            ("prompt", pa.string()),
            ("answer", pa.string()),
            ("source", pa.string()),
        ]
    ),
    "samples": pa.schema(
        [
            ("run_id", pa.string()),
            ("sample_id", pa.string()),
            ("problem_id", pa.string()),
            ("agent", pa.string()),
            ("turn", pa.int32()),
            ("parent_sample_id", pa.string()),
            ("group_id", pa.string()),
            ("group_size", pa.int32()),
            ("prompt_tokens", pa.list_(pa.int32())),
        ]
    ),
    "segments": pa.schema(
        [
            ("run_id", pa.string()),
            ("sample_id", pa.string()),
            ("segment_index", pa.int32()),
            ("token_ids", pa.list_(pa.int32())),
            ("logprobs", pa.list_(pa.float32())),
            ("policy_version", pa.int32()),
            ("finish_reason", pa.string()),
        ]
    ),
    "rewards": pa.schema(
        [
            ("run_id", pa.string()),
            ("sample_id", pa.string()),
            ("reward", pa.float32()),
            ("correct", pa.bool_()),
            ("outcome", pa.string()),
            ("parsed", pa.string()),
            ("text", pa.string()),
        ]
    ),
    "consumptions": pa.schema(
        [("run_id", pa.string()), ("sample_id", pa.string()), ("agent", pa.string()), ("learner_step", pa.int32())]
    ),
    "policy_versions": pa.schema(
        [
            ("run_id", pa.string()),
            ("version", pa.int32()),
            ("checkpoint_uri", pa.string()),
            ("mlflow_run_id", pa.string()),
        ]
    ),
    "train_steps": pa.schema(
        [("run_id", pa.string()), ("step", pa.int32()), ("agent", pa.string()), ("metrics_json", pa.string())]
    ),
    "evaluations": pa.schema(
        [("run_id", pa.string()), ("label", pa.string()), ("dataset", pa.string()), ("metrics_json", pa.string())]
    ),
    "run_events": pa.schema([("run_id", pa.string()), ("event", pa.string()), ("detail", pa.string())]),
    "rejected_inputs": pa.schema(
        [
            ("run_id", pa.string()),
            ("source", pa.string()),
            ("location", pa.string()),
            ("reason", pa.string()),
            ("payload", pa.string()),
        ]
    ),
}

_SQL_TYPES = {
    pa.string(): "VARCHAR",
    pa.int32(): "INTEGER",
    pa.float32(): "FLOAT",
    pa.bool_(): "BOOLEAN",
    pa.list_(pa.int32()): "INTEGER[]",
    pa.list_(pa.float32()): "FLOAT[]",
}


def table_ddl(catalog: str) -> list[str]:
    """CREATE TABLE statements for every event table (idempotent)."""
    statements = []
    for name, schema in ARROW_SCHEMAS.items():
        columns = ", ".join(f"{field.name} {_SQL_TYPES[field.type]}" for field in schema)
        statements.append(
            f"CREATE TABLE IF NOT EXISTS {catalog}.{name} ({columns}, created_at TIMESTAMP WITH TIME ZONE)"
        )
    return statements


def view_ddl(catalog: str) -> list[str]:
    """The views a user queries with `marsrl sql` (rewards over time, latency, staleness, in flight)."""
    c = catalog
    return [
        f"""CREATE VIEW IF NOT EXISTS {c}.rewards_per_agent AS
            SELECT s.run_id, s.agent, date_trunc('minute', r.created_at) AS minute,
                   avg(r.reward) AS mean_reward, count(*) AS samples,
                   count(*) FILTER (WHERE r.outcome IN ('no_answer', 'no_verdict')) AS unparsable
            FROM {c}.rewards r JOIN {c}.samples s USING (run_id, sample_id)
            GROUP BY ALL ORDER BY minute""",
        f"""CREATE VIEW IF NOT EXISTS {c}.pipeline_latency AS
            SELECT s.run_id, s.agent, r.sample_id, r.created_at AS finished_at, c.created_at AS consumed_at,
                   epoch(c.created_at) - epoch(r.created_at) AS latency_s
            FROM {c}.rewards r JOIN {c}.samples s USING (run_id, sample_id)
            JOIN {c}.consumptions c USING (run_id, sample_id)
            WHERE c.learner_step >= 0""",
        f"""CREATE VIEW IF NOT EXISTS {c}.staleness AS
            SELECT c.run_id, c.sample_id, c.agent, c.learner_step,
                   min(g.policy_version) AS oldest_version, max(g.policy_version) AS newest_version,
                   max(g.policy_version) - min(g.policy_version) AS versions_spanned,
                   c.learner_step - 1 - min(g.policy_version) AS staleness
            FROM {c}.consumptions c JOIN {c}.segments g USING (run_id, sample_id)
            WHERE c.learner_step >= 0
            GROUP BY c.run_id, c.sample_id, c.agent, c.learner_step""",
        f"""CREATE VIEW IF NOT EXISTS {c}.in_flight_decodes AS
            SELECT s.run_id, s.sample_id, s.agent, s.turn, count(g.sample_id) AS segments,
                   CAST(coalesce(sum(len(g.token_ids)), 0) AS BIGINT) AS tokens_so_far,
                   max(g.policy_version) AS last_version, max(g.created_at) AS last_segment_at
            FROM {c}.samples s
            LEFT JOIN {c}.segments g USING (run_id, sample_id)
            WHERE NOT EXISTS (SELECT 1 FROM {c}.rewards r WHERE r.run_id = s.run_id AND r.sample_id = s.sample_id)
            GROUP BY s.run_id, s.sample_id, s.agent, s.turn""",
    ]
