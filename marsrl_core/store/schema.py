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
_TYPES = {  # column type -> (Arrow type, SQL type)
    "string": (pa.string(), "VARCHAR"),
    "int32": (pa.int32(), "INTEGER"),
    "float32": (pa.float32(), "FLOAT"),
    "bool": (pa.bool_(), "BOOLEAN"),
    "int32[]": (pa.list_(pa.int32()), "INTEGER[]"),
    "float32[]": (pa.list_(pa.float32()), "FLOAT[]"),
}

# The tables written in bulk, as "column type" lists: the Arrow schemas of the batches and the DDL
# are both derived from them, so the two never drift apart; `created_at` is filled in at commit.
TABLES: dict[str, str] = {
    "runs": "run_id string, config_json string",
    "problems": "run_id string, problem_id string, prompt string, answer string, source string",
    "samples": "run_id string, sample_id string, problem_id string, agent string, turn int32, "
    "parent_sample_id string, group_id string, group_size int32, prompt_tokens int32[]",
    "segments": "run_id string, sample_id string, segment_index int32, token_ids int32[], logprobs float32[], "
    "policy_version int32, finish_reason string",
    "rewards": "run_id string, sample_id string, reward float32, correct bool, outcome string, parsed string, "
    "text string",
    "consumptions": "run_id string, sample_id string, agent string, learner_step int32",
    "policy_versions": "run_id string, version int32, checkpoint_uri string, mlflow_run_id string",
    "train_steps": "run_id string, step int32, agent string, metrics_json string",
    "evaluations": "run_id string, label string, dataset string, metrics_json string",
    "run_events": "run_id string, event string, detail string",
    "rejected_inputs": "run_id string, source string, location string, reason string, payload string",
}


def _columns(table: str) -> list[tuple[str, str]]:
    return [tuple(column.split()) for column in TABLES[table].split(", ")]


ARROW_SCHEMAS: dict[str, pa.Schema] = {
    table: pa.schema([(name, _TYPES[kind][0]) for name, kind in _columns(table)]) for table in TABLES
}


def table_ddl(catalog: str) -> list[str]:
    """CREATE TABLE statements for every event table (idempotent)."""
    statements = []
    for name in TABLES:
        columns = ", ".join(f"{column} {_TYPES[kind][1]}" for column, kind in _columns(name))
        statements.append(
            f"CREATE TABLE IF NOT EXISTS {catalog}.{name} ({columns}, created_at TIMESTAMP WITH TIME ZONE)"
        )
    return statements


# The step metrics the learner records per agent (`train_steps.metrics_json`), unpacked into columns by
# the `train_step_metrics` view; a test checks that a real step records no other key.
STEP_METRICS = (
    "reward_mean loss tokens tokens_per_s groups zero_variance_groups staleness_mean staleness_max "
    "clip_fraction clip_low_fraction clip_high_fraction dual_clip_fraction kl entropy ratio_mean ratio_max "
    "advantage_mean advantage_std advantage_abs_max grad_norm learning_rate decoupled_samples "
    "masked_truncated_samples skipped_nonfinite peak_memory_gb"
).split()

# The views a user queries with `marsrl sql`, over the catalog `{c}`.
VIEWS: dict[str, str] = {
    "rewards_per_agent": """SELECT s.run_id, s.agent, date_trunc('minute', r.created_at) AS minute,
            avg(r.reward) AS mean_reward, count(*) AS samples,
            count(*) FILTER (WHERE r.outcome IN ('no_answer', 'no_verdict')) AS unparsable
        FROM {c}.rewards r JOIN {c}.samples s USING (run_id, sample_id)
        GROUP BY ALL ORDER BY minute""",
    "pipeline_latency": """SELECT s.run_id, s.agent, r.sample_id, r.created_at AS finished_at,
            c.created_at AS consumed_at, epoch(c.created_at) - epoch(r.created_at) AS latency_s
        FROM {c}.rewards r JOIN {c}.samples s USING (run_id, sample_id)
        JOIN {c}.consumptions c USING (run_id, sample_id)
        WHERE c.learner_step >= 0""",
    "staleness": """SELECT c.run_id, c.sample_id, c.agent, c.learner_step,
            min(g.policy_version) AS oldest_version, max(g.policy_version) AS newest_version,
            max(g.policy_version) - min(g.policy_version) AS versions_spanned,
            c.learner_step - 1 - min(g.policy_version) AS staleness
        FROM {c}.consumptions c JOIN {c}.segments g USING (run_id, sample_id)
        WHERE c.learner_step >= 0
        GROUP BY c.run_id, c.sample_id, c.agent, c.learner_step""",
    "in_flight_decodes": """SELECT s.run_id, s.sample_id, s.agent, s.turn, count(g.sample_id) AS segments,
            CAST(coalesce(sum(len(g.token_ids)), 0) AS BIGINT) AS tokens_so_far,
            max(g.policy_version) AS last_version, max(g.created_at) AS last_segment_at
        FROM {c}.samples s
        LEFT JOIN {c}.segments g USING (run_id, sample_id)
        WHERE NOT EXISTS (SELECT 1 FROM {c}.rewards r WHERE r.run_id = s.run_id AND r.sample_id = s.sample_id)
        GROUP BY s.run_id, s.sample_id, s.agent, s.turn""",
    "train_step_metrics": "SELECT run_id, step, agent, created_at, "
    + ", ".join(f"CAST(metrics_json->>'{m}' AS DOUBLE) AS {m}" for m in STEP_METRICS)
    + " FROM {c}.train_steps",
}


def view_ddl(catalog: str) -> list[str]:
    """CREATE VIEW statements for the views users query (idempotent)."""
    return [f"CREATE VIEW IF NOT EXISTS {catalog}.{name} AS {sql.format(c=catalog)}" for name, sql in VIEWS.items()]
