"""Supervised warm start (SFT) on demonstrations, with a cache keyed by the config.

`warm_start(cfg)` builds the tiny model, trains it with cross-entropy on the response tokens of
synthetic demonstrations for all three roles (`synthetic.demonstrations`, mistakes injected), and
saves it as a Hugging Face folder under `<output_dir>/warm-start-<hash>`; the same config reuses the
folder. The hash covers the model, the roles' templates, the task and the SFT settings.

Deliberate simplifications: AdamW with a constant learning rate after a short warm-up, one packed
micro-batch per step (the demonstrations are short), no validation split.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from torch.nn.utils.rnn import pad_sequence

from marsrl_core.config import MarsRLConfig
from marsrl_core.roles import Roles
from marsrl_core.synthetic import demonstrations, make_problems

SFT_VERSION = 3  # bump when the demonstrations change, to invalidate caches


def _key(cfg: MarsRLConfig, steps: int) -> str:
    spec = {"model": cfg.model.model_dump(), "roles": cfg.roles.model_dump(), "data": cfg.data.model_dump(),
            "seed": cfg.seed, "steps": steps, "version": SFT_VERSION}
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _prompt(roles: Roles, tokenizer, role: str, fields: str) -> str:
    parts = fields.split("|")
    return roles.prompt(tokenizer, role, *parts)


def train_sft(model, tokenizer, roles: Roles, examples: list[tuple[str, str, str]], *, steps: int, batch_size: int,
              learning_rate: float, seed: int, progress: Callable[[int, float], None] | None = None) -> list[float]:
    """Cross-entropy on response tokens (the prompt is context, not a target); returns the losses."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    encoded = []
    for role, fields, target in examples:
        prompt_ids = tokenizer(_prompt(roles, tokenizer, role, fields), add_special_tokens=False)["input_ids"]
        target_ids = tokenizer(target, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        encoded.append((prompt_ids, target_ids))
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    model.train()
    losses = []
    for step in range(steps):
        batch = rng.sample(encoded, min(batch_size, len(encoded)))
        ids = [torch.tensor(p + t) for p, t in batch]
        labels = [torch.tensor([-100] * len(p) + t) for p, t in batch]
        input_ids = pad_sequence(ids, batch_first=True, padding_value=tokenizer.pad_token_id)
        label_ids = pad_sequence(labels, batch_first=True, padding_value=-100)
        mask = pad_sequence([torch.ones(len(x), dtype=torch.long) for x in ids], batch_first=True)
        loss = model(input_ids=input_ids, attention_mask=mask, labels=label_ids).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(float(loss.detach()))
        if progress is not None:
            progress(step, losses[-1])
    model.eval()
    return losses


def warm_start(cfg: MarsRLConfig, *, steps: int = 3000, batch_size: int = 64, learning_rate: float = 3e-3,
               num_problems: int = 4000, progress: Callable[[int, float], None] | None = None) -> Path:
    """The warm-started policy folder for `cfg` (trained once, then reused from the cache)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from marsrl_core.jobs import roles_from_config
    from marsrl_core.policy import policy_folder

    folder = Path(cfg.output_dir) / f"warm-start-{_key(cfg, steps)}"
    if (folder / "config.json").is_file():
        return folder
    start = policy_folder(cfg)
    model = AutoModelForCausalLM.from_pretrained(start)
    tokenizer = AutoTokenizer.from_pretrained(start)
    problems = make_problems(num_problems, cfg.seed + 1, prefix="sft", min_terms=cfg.data.synthetic_min_terms,
                             max_terms=cfg.data.synthetic_max_terms)
    examples = demonstrations(problems, random.Random(cfg.seed))
    train_sft(model, tokenizer, roles_from_config(cfg), examples, steps=steps, batch_size=batch_size,
              learning_rate=learning_rate, seed=cfg.seed, progress=progress)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    tmp.rename(folder)
    return folder
