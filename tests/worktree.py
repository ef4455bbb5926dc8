"""What a test run may leave in the working tree: nothing.

`snapshot(root)` records every file under the repository, ignored ones included, with its size and
modification time; `changes(before, after)` lists what was created, changed or deleted between two
snapshots. The session fixture in `conftest.py` compares a snapshot taken before the first test with
one taken after the last, and fails the run if they differ. Left out: the virtual environment,
bytecode, build metadata and tool caches, which running tests (or installing) rewrites by design.
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIPPED_DIRS = {".git", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache", ".mypy_cache"}


def _skipped(name: str) -> bool:
    return name in SKIPPED_DIRS or name.endswith(".egg-info")


def snapshot(root: Path = ROOT) -> dict[str, tuple[int, int]]:
    """{path relative to `root`: (size, mtime_ns)} of every file under `root` but the skipped folders."""
    files = {}
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if not _skipped(d)]
        for name in names:
            path = Path(folder) / name
            try:
                info = path.lstat()
            except FileNotFoundError:  # removed while we walked
                continue
            files[str(path.relative_to(root))] = (info.st_size, info.st_mtime_ns)
    return files


def changes(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> list[str]:
    """'created X', 'changed X' and 'deleted X' lines, sorted by path."""
    lines = [f"created {p}" for p in after.keys() - before.keys()]
    lines += [f"deleted {p}" for p in before.keys() - after.keys()]
    lines += [f"changed {p}" for p in before.keys() & after.keys() if before[p] != after[p]]
    return sorted(lines, key=lambda line: line.split(" ", 1)[1])
