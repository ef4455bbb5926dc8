"""Loading the policy model and its engine from the config.

`policy_folder(cfg)` is the Hugging Face folder the run starts from: `model.path` when set, else a
tiny model built from the `model.tiny_*` fields into `<output_dir>/tiny-model-<hash of those
fields>` (built once, then reused). `make_engine(cfg, folder)` opens the configured engine on it;
`roles_from_config(cfg)` gives the agents' prompt templates.

Deliberate simplification: the `openai` engine assumes the server serves the same model folder
(its tokenizer is loaded locally from `folder`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
from pathlib import Path

from marsrl_core.agents.roles import CODE_TEMPLATES, DEFAULT_TEMPLATES, TINY_TEMPLATES, Roles
from marsrl_core.config import MarsRLConfig
from marsrl_core.engines.base import EngineError

_build_lock = threading.Lock()


def policy_folder(cfg: MarsRLConfig) -> Path:
    if cfg.model.path is not None:
        folder = Path(cfg.model.path)
        if not (folder / "config.json").is_file():
            raise EngineError(f"model.path={cfg.model.path!r}: not a Hugging Face model folder (no config.json)")
        return folder
    from marsrl_core.demo.tiny import build_tiny_model

    spec = {k: v for k, v in cfg.model.model_dump().items() if k.startswith("tiny_")} | {"seed": cfg.seed}
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:10]
    folder = Path(cfg.output_dir) / f"tiny-model-{digest}"
    with _build_lock:
        if not (folder / "config.json").is_file():  # built once, into a temporary folder, then renamed
            tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}-{threading.get_ident()}")
            build_tiny_model(
                tmp,
                hidden_size=cfg.model.tiny_hidden_size,
                num_layers=cfg.model.tiny_num_layers,
                num_heads=cfg.model.tiny_num_heads,
                max_position_embeddings=cfg.model.tiny_max_position_embeddings,
                seed=cfg.seed,
            )
            try:
                os.rename(tmp, folder)
            except OSError:  # another process won the race: its folder is just as good
                shutil.rmtree(tmp, ignore_errors=True)
    return folder


def make_engine(cfg: MarsRLConfig, folder: Path):
    """The configured engine serving the policy in `folder` (for `openai`, the server serves it)."""
    if cfg.engine.name == "hf":
        from marsrl_core.devices import attn_implementation, resolve_device
        from marsrl_core.engines.hf import HFEngine

        device = resolve_device(cfg.model.device)
        return HFEngine.from_pretrained(
            folder,
            dtype=cfg.model.dtype,
            device=device,
            attn=attn_implementation(cfg.model.attn_implementation, device),
            kv_cache_mb=cfg.engine.kv_cache_mb,
        )
    if cfg.engine.name == "vllm":
        from marsrl_core.engines.vllm import VLLMEngine

        return VLLMEngine(
            folder,
            dtype=cfg.model.dtype,
            seed=cfg.seed,
            gpu_memory_utilization=cfg.engine.gpu_memory_utilization,
            tensor_parallel_size=cfg.engine.tensor_parallel_size,
        )
    from transformers import AutoTokenizer

    from marsrl_core.engines.openai import OpenAIEngine

    if not cfg.engine.base_url:
        raise EngineError("engine.base_url: required for engine 'openai' (e.g. http://host:8000/v1)")
    return OpenAIEngine(cfg.engine.base_url, tokenizer=AutoTokenizer.from_pretrained(folder))


def roles_from_config(cfg: MarsRLConfig) -> Roles:
    base = {"tiny": TINY_TEMPLATES, "code": CODE_TEMPLATES}.get(cfg.roles.templates, DEFAULT_TEMPLATES)
    return Roles.from_config(
        {"solver": cfg.roles.solver, "verifier": cfg.roles.verifier, "corrector": cfg.roles.corrector}, base=base
    )
