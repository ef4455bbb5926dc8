"""What the read-only SQL console lets through: reads of the store, nothing that writes.

Three layers, each enough for what it covers:
- DuckLake's READ_ONLY attach refuses every write to the lake's tables and catalog;
- DuckDB's file access is limited to the store's data path (`allowed_directories`), locked so no
  statement can widen it, so `read_parquet('/etc/...')` is refused while the store's Parquet is read;
- `refusal(con, sql)` (here) refuses every statement but SELECT and EXPLAIN, and in those every table
  function not in `READ_TABLE_FUNCTIONS`: DuckLake's maintenance calls (`ducklake_flush_inlined_data`,
  `ducklake_set_option`, ...) are table functions that a SELECT can call, and `query()` runs SQL text.

The statements are parsed by DuckDB itself (`extract_statements`, `json_serialize_sql`), not by a
pattern; a SELECT whose syntax tree cannot be serialized is refused unless it is a read-only PRAGMA.
"""

from __future__ import annotations

import json
import re
from typing import Any

import duckdb

# Table functions a console query may call: readers of files (inside the data path), generators, the
# catalog's views and DuckLake's read-only views of its snapshots and files.
READ_TABLE_FUNCTIONS = frozenset(
    """read_parquet parquet_scan read_csv read_csv_auto read_json read_json_auto read_ndjson read_ndjson_auto
    read_json_objects read_json_objects_auto read_ndjson_objects read_text read_blob glob sniff_csv
    parquet_metadata parquet_schema parquet_file_metadata parquet_kv_metadata parquet_full_metadata
    range generate_series unnest repeat repeat_row json_each json_tree
    duckdb_columns duckdb_constraints duckdb_databases duckdb_dependencies duckdb_functions duckdb_indexes
    duckdb_keywords duckdb_schemas duckdb_sequences duckdb_settings duckdb_tables duckdb_types duckdb_views
    pragma_table_info pragma_show pragma_version pragma_database_size pragma_storage_info
    pragma_metadata_info pragma_platform pragma_collations pg_timezone_names icu_calendar_names
    ducklake_snapshots ducklake_table_info ducklake_list_files ducklake_table_changes ducklake_table_insertions
    ducklake_table_deletions ducklake_current_snapshot ducklake_last_committed_snapshot ducklake_options
    ducklake_settings""".split()
)
# PRAGMAs that only read (DuckDB runs them as a SELECT, which its serializer does not take).
READ_PRAGMAS = frozenset(
    "show_tables show_tables_expanded table_info show database_list version database_size storage_info "
    "metadata_info collations platform functions".split()
)
READ_STATEMENTS = (duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN)
_EXPLAIN = re.compile(r"^\s*EXPLAIN\s+(ANALYZE\s+)?", re.IGNORECASE)
_PRAGMA = re.compile(r"^\s*PRAGMA\s+(\w+)", re.IGNORECASE)


def refusal(con: duckdb.DuckDBPyConnection, sql: str) -> str | None:
    """Why `sql` may not run on a read-only store (one line), or None when it only reads."""
    statements = con.extract_statements(sql)
    kinds = sorted({s.type.name for s in statements if s.type not in READ_STATEMENTS})
    if kinds:
        return f"{', '.join(kinds)} statements are refused (SELECT and EXPLAIN run; `marsrl compact` does maintenance)"
    for statement in statements:
        text = statement.query
        if statement.type == duckdb.StatementType.EXPLAIN:
            text = _EXPLAIN.sub("", text, count=1)
            inner = con.extract_statements(text)
            if len(inner) != 1 or inner[0].type != duckdb.StatementType.SELECT:
                return "EXPLAIN of a statement that is not a SELECT is refused"
        reason = _select_refusal(con, text)
        if reason:
            return reason
    return None


def _select_refusal(con: duckdb.DuckDBPyConnection, text: str) -> str | None:
    tree = json.loads(con.execute("SELECT json_serialize_sql(?)", [text]).fetchone()[0])
    if tree.get("error"):
        pragma = _PRAGMA.match(text)
        if pragma and pragma.group(1).lower() in READ_PRAGMAS:
            return None
        return "this statement cannot be checked as read-only, so it is refused"
    called = sorted(set(_table_functions(tree)) - READ_TABLE_FUNCTIONS)
    if called:
        return f"the table function {called[0]}() is refused (it writes, or runs other SQL)"
    return None


def _table_functions(node: Any):
    """The names of the table functions anywhere in a serialized statement."""
    if isinstance(node, dict):
        if node.get("type") == "TABLE_FUNCTION":
            yield node["function"]["function_name"].lower()
        for value in node.values():
            yield from _table_functions(value)
    elif isinstance(node, list):
        for value in node:
            yield from _table_functions(value)
