"""The transformers engine: batched segment decoding with a KV cache, on `model.device` (CPU or GPU).

Requests are left-padded into one batch (prompt + already-decoded prefix), with position ids taken
from the attention mask so padding does not shift RoPE positions. Each step samples one token per
active request, under that request's own sampling parameters; a request stops at EOS, at a stop
string, or when its segment is full.

The log-prob recorded for a sampled token is `log_softmax(logits / T)` at that token, T the sampling
temperature (T = 1 for greedy), i.e. the behaviour policy before top-k/top-p truncation; the learner
scores tokens the same way, so on-policy ratios are exactly 1.

Weights are updated in place (`update_weights(version, state_dict or checkpoint folder)`); a
checkpoint is read from safetensors only, never from pickle, and with `pread` rather than safetensors'
default mmap: safetensors 0.8.0's mmap path keeps about 1.2 KB of Python objects alive per file opened,
which a rollout reloading weights at every policy version accumulates (`tests/test_engine_hf.py`).

An unfinished sample's keys and values are kept for its next segment, and a batch's rows that share
a context (a group's prompt) are prefilled once (`kv_cache.py`); loading new weights drops them.

A segment's keys and values go into a cache preallocated for the whole segment (transformers'
`StaticCache`), where a growing cache would copy itself at every token step.

A model with sliding-window layers (whose cache keeps only the window) keeps no context and encodes
each segment's rows whole, in a growing cache.

Once a quarter of a segment batch's rows have ended (EOS, a stop string, or their segment full), the
batch drops them, so the token steps that follow compute only rows still decoding.

Deliberate simplifications: no paged attention or continuous batching (that is vLLM's job); a
segment batch is left-padded to its longest row, and a row that ended is decoded on (its tokens
dropped) until a quarter of the batch has ended.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import DynamicCache

from marsrl_core.engines.base import EngineError, SamplingParams, SegmentRequest, SegmentResult, derive_seed
from marsrl_core.engines.kv_cache import (
    LayerKV,
    SegmentKVCache,
    batch_cache,
    keep_rows,
    left_padded,
    prefill_contexts,
    rows_kv,
)
from marsrl_core.timings import timed


def load_model_folder(
    path: str | Path, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu", attn: str = "sdpa"
):
    """A causal LM from a Hugging Face folder, from safetensors only, in `dtype` ('auto': as stored) on
    `device` with attention kernel `attn`; EngineError names what is wrong."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if not (path / "config.json").is_file():
        raise EngineError(f"model folder {str(path)!r}: not found or has no config.json")
    for file in _safetensors_files(path):  # refuses pickle-only folders; a cut-short file fails its header check
        try:
            with safe_open(str(file), "pt"):
                pass
        except Exception as err:
            raise EngineError(f"checkpoint file {str(file)!r}: cannot be read ({err})") from None
    try:
        dtype = getattr(torch, dtype) if isinstance(dtype, str) and dtype != "auto" else dtype
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_safetensors=True, attn_implementation=attn)
        return model.to(device)
    except Exception as err:
        raise EngineError(f"model folder {str(path)!r}: cannot be loaded ({err})") from None


def empty_model(path: str | Path, dtype: torch.dtype, attn: str = "sdpa"):
    """The causal LM of a Hugging Face folder's config with its parameters on the meta device (no memory)
    and its buffers (rotary frequencies) real on the CPU: a sharded learner's ranks shard it before any
    weight exists (`distributed.fill_from_rank0`). Built by accelerate's `init_empty_weights`."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    if not (path / "config.json").is_file():
        raise EngineError(f"model folder {str(path)!r}: not found or has no config.json")
    with init_empty_weights(include_buffers=False):
        config = AutoConfig.from_pretrained(path)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    model.tie_weights()  # init_empty_weights registers a new meta parameter where the config ties two
    return model


def _safetensors_files(folder: str | Path) -> list[Path]:
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise EngineError(f"checkpoint {str(folder)!r}: no .safetensors files (pickle checkpoints are refused)")
    return files


def load_safetensors_state(folder: str | Path) -> dict[str, torch.Tensor]:
    """The state dict of a Hugging Face checkpoint folder, from its safetensors files only."""
    state: dict[str, torch.Tensor] = {}
    for path in _safetensors_files(folder):
        try:
            state.update(read_safetensors(path))
        except Exception as err:  # a truncated or corrupt file
            raise EngineError(f"checkpoint file {str(path)!r}: cannot be read ({err})") from None
    return state


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file, read with pread (see the module docstring: no per-call leak)."""
    return load_file(str(path), backend="pread")


def _filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[..., -1, None]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, -1).cumsum(-1)
        remove = cumulative - torch.softmax(sorted_logits, -1) >= top_p
        logits = logits.masked_fill(remove.scatter(-1, order, remove), float("-inf"))
    return logits


class HFEngine:
    """transformers model + tokenizer behind the segment interface."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        policy_version: int = 0,
        stop_strings: Sequence[str] = (),
        kv_cache_mb: float = 256,
    ):
        self.model, self.tokenizer = model.eval(), tokenizer
        self.policy_version = policy_version
        self.stop_strings = tuple(stop_strings)
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id
        if self.eos_id is None:
            raise EngineError("tokenizer: has no eos_token_id; the engine cannot tell when an output ends")
        self.max_positions = getattr(model.config, "max_position_embeddings", None)
        # Sampling needs the logits of the last position only: at a segment's prefill the others would be
        # a [batch x prompt x vocabulary] tensor (2.9 GB for 16 prompts of 300 tokens and a 152K vocabulary).
        self.last_logits_only = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.kv_cache = SegmentKVCache(int(kv_cache_mb * 2**20))  # unfinished samples' contexts (kv_cache.py)
        # A sliding-window layer's cache holds only its window, so contexts cannot be cut out of it or joined.
        types = getattr(model.config, "layer_types", None)
        self.keeps_contexts = (
            all(t == "full_attention" for t in types)
            if types is not None
            else getattr(model.config, "sliding_window", None) is None
        )

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        dtype: str = "float32",
        device: str | torch.device = "cpu",
        attn: str = "sdpa",
        **kwargs: Any,
    ) -> HFEngine:
        from transformers import AutoTokenizer

        model = load_model_folder(path, dtype, device, attn)  # checks the folder first
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
        except Exception as err:
            raise EngineError(f"model folder {str(path)!r}: tokenizer cannot be loaded ({err})") from None
        return cls(model, tokenizer, **kwargs)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def update_weights(self, version: int, weights: dict[str, torch.Tensor] | str | Path) -> None:
        """Load new weights in place (a state dict, or a checkpoint folder's safetensors)."""
        state = weights if isinstance(weights, dict) else load_safetensors_state(weights)
        self.kv_cache.clear()  # keys and values of the old weights
        with torch.no_grad():
            missing, unexpected = self.model.load_state_dict(state, strict=False)
        # Tied parameters (e.g. lm_head sharing the input embeddings) are saved once: a key missing
        # from the file is fine when its tensor is the same storage as a key that was loaded.
        tensors = self.model.state_dict(keep_vars=True)
        loaded = {tensors[k].data_ptr() for k in state if k in tensors}
        missing = [m for m in missing if "rotary" not in m and tensors[m].data_ptr() not in loaded]
        if unexpected or missing:
            raise EngineError(
                f"update_weights(version={version}): weights do not fit the model "
                f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
            )
        self.policy_version = version

    def _check_lengths(self, requests: Sequence[SegmentRequest]) -> None:
        for i, r in enumerate(requests):
            if r.max_new_tokens < 1:
                raise EngineError(f"request {i}: max_new_tokens={r.max_new_tokens} must be >= 1")
            total = len(r.prompt_ids) + len(r.prefix_ids) + r.max_new_tokens
            if self.max_positions is not None and total > self.max_positions:
                raise EngineError(
                    f"request {i}: prompt ({len(r.prompt_ids)}) + prefix ({len(r.prefix_ids)}) + max_new_tokens "
                    f"({r.max_new_tokens}) = {total} tokens exceeds the model's context of {self.max_positions}"
                )

    @torch.no_grad()
    def decode_segment(self, requests: Sequence[SegmentRequest]) -> list[SegmentResult]:
        if not requests:
            return []
        self._check_lengths(requests)
        device, batch = self.device, len(requests)
        sequences = [tuple(r.prompt_ids) + tuple(r.prefix_ids) for r in requests]
        steps = max(r.max_new_tokens for r in requests)
        if self.keeps_contexts:
            # Each row's context (all its tokens but the last) comes from the cache or a prefill, in a cache
            # preallocated for the segment; the first step feeds the last tokens.
            lengths = [len(s) - 1 for s in sequences]
            width = max(lengths)
            cache = batch_cache(self.model.config, self._contexts(sequences), width, width + steps)
            mask = torch.zeros((batch, width + steps), dtype=torch.long, device=device)  # the cache's slots in use
            for i, length in enumerate(lengths):
                mask[i, width - length : width + 1] = 1
            step_ids = torch.tensor([s[-1] for s in sequences], dtype=torch.long, device=device)[:, None]
            step_pos = torch.tensor(lengths, dtype=torch.long, device=device)[:, None]
        else:
            # Sliding-window layers keep only their window of a row: the first step encodes the whole
            # left-padded rows into a growing cache, and no context is kept.
            lengths = [len(s) for s in sequences]
            width = max(lengths)
            cache = DynamicCache()
            step_ids, mask, step_pos = left_padded(sequences, self.pad_id, device)
        generators = [self._generator(r.sampling, len(r.prefix_ids)) for r in requests]
        new_tokens: list[list[int]] = [[] for _ in requests]
        new_logprobs: list[list[float]] = [[] for _ in requests]
        finished = [False] * batch
        active = [True] * batch
        rows = list(range(batch))  # the request of each row of the model's batch

        def keep_context(row: int, i: int) -> None:  # an unfinished output's context for its next segment
            if self.keeps_contexts and not finished[i]:
                start, end = width - lengths[i], width + len(new_tokens[i])
                self.kv_cache.put(sequences[i] + tuple(new_tokens[i]), rows_kv(cache, row, start, end))

        for step in range(steps):
            keep = {"logits_to_keep": 1} if self.last_logits_only else {}
            out = self.model(
                input_ids=step_ids,
                attention_mask=mask,
                position_ids=step_pos,
                past_key_values=cache,
                use_cache=True,
                **({"cache_position": torch.tensor([width + step], device=device)} if self.keeps_contexts else {}),
                **keep,
            )
            logits = out.logits[:, -1, :].float()
            live = [row for row, i in enumerate(rows) if active[i]]
            asked = [rows[row] for row in live]
            tokens, logprobs = self._sample_rows(
                logits[live], [requests[i].sampling for i in asked], [generators[i] for i in asked]
            )
            next_ids = torch.full((len(rows),), self.pad_id, dtype=torch.long, device=device)
            for row, i, token, logprob in zip(live, asked, tokens.tolist(), logprobs.tolist()):
                next_ids[row] = token
                new_tokens[i].append(token)
                new_logprobs[i].append(logprob)
                if token == self.eos_id or self._hit_stop(new_tokens[i]):
                    finished[i], active[i] = True, False
                elif len(new_tokens[i]) >= requests[i].max_new_tokens:
                    active[i] = False
            if not any(active):
                break
            if self.keeps_contexts:
                mask[:, width + step + 1] = 1
            else:
                mask = torch.cat([mask, torch.ones((len(rows), 1), dtype=mask.dtype, device=device)], dim=1)
            step_ids, step_pos = next_ids[:, None], step_pos[:, -1:] + 1
            ended = [row for row, i in enumerate(rows) if not active[i]]
            if 4 * len(ended) >= len(rows):  # a quarter of the rows decode nothing more: the batch drops them
                for row in ended:
                    keep_context(row, rows[row])
                kept = torch.tensor([row for row, i in enumerate(rows) if active[i]], device=device)
                keep_rows(cache, kept)
                mask, step_ids, step_pos = mask[kept], step_ids[kept], step_pos[kept]
                rows = [rows[row] for row in kept.tolist()]
        for row, i in enumerate(rows):
            keep_context(row, i)
        return [SegmentResult(t, lp, f, self.policy_version) for t, lp, f in zip(new_tokens, new_logprobs, finished)]

    def _contexts(self, sequences: list[tuple[int, ...]]) -> list[LayerKV | None]:
        """Each row's context keys and values (None where it is empty): kept from the row's previous
        segment, else prefilled, one prefill row per distinct context."""
        contexts: list[LayerKV | None] = [None] * len(sequences)
        missing: dict[tuple[int, ...], list[int]] = {}
        for i, sequence in enumerate(sequences):
            if len(sequence) > 1:
                contexts[i] = self.kv_cache.take(sequence)
                if contexts[i] is None:
                    missing.setdefault(sequence[:-1], []).append(i)
        if missing:
            with timed("rollout.prefill"):
                encoded = prefill_contexts(self.model, list(missing), self.pad_id, self.device, self.last_logits_only)
            for rows, kv in zip(missing.values(), encoded):
                for i in rows:
                    contexts[i] = kv
        return contexts

    def _generator(self, sampling: SamplingParams, offset: int) -> torch.Generator | None:
        if sampling.seed is None:
            return None
        generator = torch.Generator(device=self.device)
        generator.manual_seed(derive_seed(sampling.seed, offset))
        return generator

    @staticmethod
    def _sample_rows(
        logits: torch.Tensor, sampling: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row, vectorised: greedy rows take the argmax; sampled rows use the Gumbel-max
        trick with noise from each row's own generator (so seeded requests stay reproducible)."""
        temps = torch.tensor([s.temperature or 1.0 for s in sampling], device=logits.device)
        scaled = logits / temps[:, None]
        logprobs = torch.log_softmax(scaled, -1)
        greedy = torch.tensor([s.temperature == 0 for s in sampling], device=logits.device)
        tokens = torch.argmax(logits, -1)
        if not bool(greedy.all()):
            filtered = scaled.clone()
            for row, s in enumerate(sampling):
                if s.top_k > 0 or s.top_p < 1.0:
                    filtered[row] = _filter_logits(scaled[row], s.top_k, s.top_p)
            noise = torch.stack(
                [torch.rand(logits.shape[-1], generator=g, device=logits.device) for g in generators]
            ).clamp_(min=1e-20)
            sampled = torch.argmax(filtered - torch.log(-torch.log(noise)), -1)
            tokens = torch.where(greedy, tokens, sampled)
        return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)

    def _hit_stop(self, tokens: list[int]) -> bool:
        if not self.stop_strings:
            return False
        tail = self.tokenizer.decode(tokens[-16:], skip_special_tokens=True)
        return any(stop in tail for stop in self.stop_strings)
