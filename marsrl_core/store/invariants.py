"""The store's exactly-once invariants, as queries: what must hold for every run at any moment.

Each invariant is a count of offending keys that must be 0. `SegmentStore.invariants(run_id)` runs them
all in one query; `marsrl check RUN` prints them, and the multi-process tests check them at the end of
every run.
"""

from __future__ import annotations

# name -> (what a non-zero count means, the count over the run's rows; `{c}` is the catalog, $1 the run)
INVARIANTS: dict[str, tuple[str, str]] = {
    "samples_stored_twice": (
        "sample ids stored more than once",
        "SELECT count(*) FROM (SELECT sample_id FROM {c}.samples WHERE run_id = $1 GROUP BY 1 HAVING count(*) > 1)",
    ),
    "segments_stored_twice": (
        "(sample_id, segment_index) pairs stored more than once",
        "SELECT count(*) FROM (SELECT sample_id, segment_index FROM {c}.segments WHERE run_id = $1 "
        "GROUP BY 1, 2 HAVING count(*) > 1)",
    ),
    "segment_gaps": (
        "samples whose segment indices are not 0, 1, ..., n-1",
        "SELECT count(*) FROM (SELECT sample_id FROM {c}.segments WHERE run_id = $1 GROUP BY 1 "
        "HAVING max(segment_index) + 1 <> count(DISTINCT segment_index) OR min(segment_index) <> 0)",
    ),
    "samples_rewarded_twice": (
        "samples with more than one reward",
        "SELECT count(*) FROM (SELECT sample_id FROM {c}.rewards WHERE run_id = $1 GROUP BY 1 HAVING count(*) > 1)",
    ),
    "samples_consumed_twice": (
        "samples consumed (trained or dropped) by more than one learner step",
        "SELECT count(*) FROM (SELECT sample_id FROM {c}.consumptions WHERE run_id = $1 GROUP BY 1 "
        "HAVING count(*) > 1)",
    ),
    "consumed_without_reward": (
        "consumed samples that have no reward",
        "SELECT count(*) FROM {c}.consumptions c WHERE c.run_id = $1 AND NOT EXISTS "
        "(SELECT 1 FROM {c}.rewards r WHERE r.run_id = c.run_id AND r.sample_id = c.sample_id)",
    ),
    "versions_committed_twice": (
        "policy versions committed more than once",
        "SELECT count(*) FROM (SELECT version FROM {c}.policy_versions WHERE run_id = $1 GROUP BY 1 "
        "HAVING count(*) > 1)",
    ),
}


def invariants_sql(catalog: str) -> str:
    """One query whose single row has a column per invariant."""
    return "SELECT " + ", ".join(f"({sql.format(c=catalog)}) AS {name}" for name, (_, sql) in INVARIANTS.items())
