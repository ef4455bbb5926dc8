"""Loading the policy model and its engine from the config.

`policy_folder(cfg)` is the Hugging Face folder the run starts from: `model.path` when set, else a
tiny model built from the `model.tiny_*` fields into `<output_dir>/tiny-model-<hash of those
fields>` (built once, then reused). `make_engine(cfg, folder)` opens the configured engine on it.

Deliberate simplification: only the `hf` engine exists so far; asking for `vllm` or `openai` says so.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from marsrl_core.config import MarsRLConfig
from marsrl_core.engines.base import EngineError

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever downloaded
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def policy_folder(cfg: MarsRLConfig) -> Path:
    if cfg.model.path is not None:
        folder = Path(cfg.model.path)
        if not (folder / "config.json").is_file():
            raise EngineError(f"model.path={cfg.model.path!r}: not a Hugging Face model folder (no config.json)")
        return folder
    from marsrl_core.tiny import build_tiny_model

    spec = {k: v for k, v in cfg.model.model_dump().items() if k.startswith("tiny_")} | {"seed": cfg.seed}
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:10]
    folder = Path(cfg.output_dir) / f"tiny-model-{digest}"
    if not (folder / "config.json").is_file():
        build_tiny_model(folder, hidden_size=cfg.model.tiny_hidden_size, num_layers=cfg.model.tiny_num_layers,
                         num_heads=cfg.model.tiny_num_heads,
                         max_position_embeddings=cfg.model.tiny_max_position_embeddings, seed=cfg.seed)
    return folder


def make_engine(cfg: MarsRLConfig, folder: Path):
    if cfg.engine.name == "hf":
        from marsrl_core.engines.hf import HFEngine

        return HFEngine.from_pretrained(folder, dtype=cfg.model.dtype)
    raise EngineError(f"engine.name={cfg.engine.name!r}: this engine is not built yet; use 'hf'")
