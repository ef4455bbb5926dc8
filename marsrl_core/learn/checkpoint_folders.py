"""Where a run's checkpoint versions live, which are durable, and which are deleted.

A run's versions are the folders `<output_dir>/checkpoints/<run>/v<v>` (`checkpoint_root`,
`version_folder`); each holds one `save_pretrained` folder per policy (`policy` when shared, else
`solver`/`verifier`/`corrector`: `policy_names`; `agent_folders` maps each agent to its model folder).
A durable version also holds the trainer state (`is_durable`; `checkpoint.py` writes and reads the
contents). Folders of versions newer than a resume's starting point, and temporary folders, are
removed on resume (`clean_uncommitted`); `prune_checkpoints` keeps the newest durable versions
(`learner.save_total_limit`) and what is newer than the newest of them.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from pathlib import Path

from marsrl_core.config import AGENTS

STATE_TENSORS, STATE_JSON = "trainer_state.safetensors", "trainer_state.json"


class CheckpointError(RuntimeError):
    """A checkpoint folder is missing or incomplete; the message names the folder."""


SHARED_POLICY = "policy"  # the model folder of a shared policy inside a checkpoint


def checkpoint_root(output_dir: str | Path, run_id: str) -> Path:
    """Where a run's checkpoint versions are written."""
    return Path(output_dir) / "checkpoints" / run_id


def version_folder(root: Path, version: int) -> Path:
    return Path(root) / f"v{version}"


def policy_names(per_agent: bool) -> list[str]:
    """The policies a checkpoint holds: one shared, or one per agent."""
    return list(AGENTS) if per_agent else [SHARED_POLICY]


def agent_folders(folder: Path) -> dict[str, Path]:
    """The model folder each agent loads from `folder`: a Hugging Face model folder (the same for every
    agent), or a checkpoint version (its shared `policy` folder, or one folder per agent)."""
    folder = Path(folder)
    if (folder / "config.json").is_file():
        return {agent: folder for agent in AGENTS}
    shared = (folder / SHARED_POLICY).is_dir()
    return {agent: folder / (SHARED_POLICY if shared else agent) for agent in AGENTS}


def is_durable(folder: Path) -> bool:
    """Whether a version folder holds the trainer state a resume needs (not weights alone)."""
    return (Path(folder) / STATE_JSON).is_file()


def newest_durable(root: Path, at_most: int) -> int:
    """The newest durable version not newer than `at_most` in `root`; 0 (the starting policy) if none."""
    return max((v for v, path in _version_folders(Path(root)) if v <= at_most and is_durable(path)), default=0)


def _version_folders(root: Path) -> list[tuple[int, Path]]:
    """The `v<v>` folders under `root` with their versions, oldest first."""
    if not root.exists():
        return []
    return sorted((int(m.group(1)), path) for path in root.iterdir() if (m := re.fullmatch(r"v(\d+)", path.name)))


def clean_uncommitted(root: Path, committed_version: int | None) -> list[Path]:
    """Delete temporary folders and version folders newer than the last committed version."""
    root = Path(root)
    if not root.exists():
        return []
    removed = [path for path in root.iterdir() if path.name.startswith("tmp-")]
    removed += [
        path for version, path in _version_folders(root) if committed_version is None or version > committed_version
    ]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def prune_checkpoints(root: Path, keep: int) -> list[Path]:
    """Keep the `keep` (>= 1) newest durable versions, every version newer than the newest durable one,
    and the newest version; delete the other folders. Each is first renamed to a temporary name, so a
    crash half-way through a deletion leaves no partial `v<v>` folder (resume removes `tmp-*`)."""
    if keep < 1:
        raise CheckpointError(f"prune_checkpoints(keep={keep}): must keep at least the newest version")
    folders = _version_folders(Path(root))
    durable = [v for v, path in folders if is_durable(path)]
    kept = set(durable[-keep:]) | {v for v, _ in folders[-1:]}
    newest_durable_version = durable[-1] if durable else 0
    removed = [path for v, path in folders if v not in kept and v <= newest_durable_version]
    for path in removed:
        doomed = path.with_name(f"tmp-delete-{path.name}-{uuid.uuid4().hex[:8]}")
        os.replace(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    return removed
