"""Supervised warm start (SFT) on demonstrations, with a cache keyed by the config.

`warm_start(cfg)` builds the tiny model, trains it with cross-entropy on the response tokens of
synthetic demonstrations for all three roles (`synthetic.demonstrations`, mistakes injected), and
saves it as a Hugging Face folder under `<output_dir>/warm-start-<hash>`; the same config reuses the
folder, as it does a folder of that name committed under `demo/warm-starts/`. The hash covers the
model, the roles' templates, the task and the SFT settings.

The loss is the mean over demonstrations of each one's mean token loss, so a Verifier report three
times longer than a solution does not outweigh it (a plain token mean let the long reports dominate
and the Solver stayed near 10% after 2,000 steps here).

Deliberate simplifications: AdamW with a constant learning rate after a short warm-up, one padded
batch per step (the demonstrations are short), no validation split.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from torch.nn.utils.rnn import pad_sequence

from marsrl_core.agents.roles import Roles
from marsrl_core.config import MarsRLConfig
from marsrl_core.demo.synthetic import demonstrations, make_problems

# Warm starts shipped with the repository (made by `marsrl sft --set output_dir=demo/warm-starts`), so a
# fresh machine's `make train` skips the SFT when its config matches one of them.
COMMITTED = Path(__file__).resolve().parents[2] / "demo" / "warm-starts"
SFT_VERSION = 6  # bump when the demonstrations change, to invalidate caches


def _key(cfg: MarsRLConfig) -> str:
    task = {k: v for k, v in cfg.data.model_dump().items() if k.startswith("synthetic_")}
    if cfg.data.verifier == "code":  # the code form; the arithmetic form's key holds no verifier
        task["verifier"] = "code"
    spec = {
        "model": cfg.model.model_dump(exclude={"device", "attn_implementation"}),  # where it runs, not what
        "roles": cfg.roles.model_dump(),
        "task": task,
        "sft": cfg.sft.model_dump(exclude={"enabled"}),
        "seed": cfg.seed,
        "version": SFT_VERSION,
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _prompt(roles: Roles, tokenizer, role: str, fields: str) -> str:
    parts = fields.split("|")
    return roles.prompt(tokenizer, role, *parts)


def train_sft(
    model,
    tokenizer,
    roles: Roles,
    examples: list[tuple[str, str, str]],
    *,
    steps: int,
    batch_size: int,
    learning_rate: float,
    seed: int,
    progress: Callable[[int, float], None] | None = None,
) -> list[float]:
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
        logits = model(input_ids=input_ids, attention_mask=mask).logits[:, :-1]
        targets = label_ids[:, 1:]
        token_loss = torch.nn.functional.cross_entropy(
            logits.transpose(1, 2), targets, ignore_index=-100, reduction="none"
        )
        counted = (targets != -100).sum(dim=1).clamp(min=1)
        loss = (token_loss.sum(dim=1) / counted).mean()  # each demonstration counts once, long or short
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


def find_warm_start(cfg: MarsRLConfig) -> Path | None:
    """The warm start for `cfg` if one was made already: committed in the repository, or cached."""
    name = f"warm-start-{_key(cfg)}"
    for cached in (COMMITTED / name, Path(cfg.output_dir) / name):
        if (cached / "config.json").is_file():
            return cached
    return None


def warm_start(
    cfg: MarsRLConfig, start: Path, roles: Roles, progress: Callable[[int, float], None] | None = None
) -> Path:
    """The warm-started policy folder for `cfg` (trained once with `cfg.sft` from the model in `start`
    with the agents' `roles`, then reused from the cache)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cached = find_warm_start(cfg)
    if cached is not None:
        return cached
    folder = Path(cfg.output_dir) / f"warm-start-{_key(cfg)}"
    sc, code = cfg.sft, cfg.data.verifier == "code"  # the task's code form (`synthetic.py`)
    model = AutoModelForCausalLM.from_pretrained(start)
    tokenizer = AutoTokenizer.from_pretrained(start)
    problems = make_problems(
        sc.num_problems,
        cfg.seed + 1,
        prefix="sft",
        min_terms=cfg.data.synthetic_min_terms,
        max_terms=cfg.data.synthetic_max_terms,
        code=code,
    )
    examples = demonstrations(
        problems,
        random.Random(cfg.seed),
        solver_error=sc.solver_error,
        verdict_flip=sc.verdict_flip,
        repair_failure=sc.repair_failure,
        report_corruption=sc.report_corruption,
        code=code,
    )
    schedule = {"steps": sc.max_steps, "batch_size": sc.per_device_train_batch_size, "learning_rate": sc.learning_rate}
    train_sft(model, tokenizer, roles, examples, seed=cfg.seed, progress=progress, **schedule)
    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    tmp.rename(folder)
    return folder
