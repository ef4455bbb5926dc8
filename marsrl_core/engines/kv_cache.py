"""The transformers engine's KV cache across a sample's segments, and the prefill that shares prompts.

A segment rollout decodes an output a segment at a time, and the next segment's request carries the
whole prefix again. Re-encoding it is what a stateless engine does (and what vLLM's prefix cache
makes cheap); here each unfinished row's keys and values are kept after its segment, under the
token ids the next request of that sample will carry (prompt + prefix + this segment's tokens), and
that request starts from them instead of a prefill. Rows whose context is not kept are prefilled,
one row per distinct context: the samples of a group share their prompt, so a group's first segment
encodes it once.

Exactness: an entry holds keys and values computed under one policy version, and loading new weights
(`clear`) drops every entry, so a sample continued under a newer version is re-encoded under it, as
without the cache. A continued row's keys were computed in another batch than the one it joins, so its
floats can differ in the last bits from a fresh prefill's, as a row's already do with its batch's
padding.

Deliberate simplifications: entries are evicted least recently stored first once they hold more than
`max_bytes`; an entry is used once (its sample's next request takes it out); a sample whose next
request never comes (its batch dropped at a run's end) waits for eviction or the next weight load.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch
from transformers import Cache, StaticCache

LayerKV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys and values, each [heads, tokens, head_dim]


class SegmentKVCache:
    """Keys and values of unfinished samples' contexts, keyed by the token ids of their next request."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[int, ...], LayerKV] = OrderedDict()
        self._bytes = 0
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def take(self, tokens: tuple[int, ...]) -> LayerKV | None:
        """The entry of a request whose prompt + prefix is `tokens` (its context: all but the last), removed."""
        kv = self._entries.pop(tokens, None)
        if kv is None:
            self.misses += 1
            return None
        self.hits += 1
        self._bytes -= _size(kv)
        return kv

    def put(self, tokens: tuple[int, ...], kv: LayerKV) -> None:
        if self.max_bytes <= 0:
            return
        if (old := self._entries.pop(tokens, None)) is not None:
            self._bytes -= _size(old)
        self._entries[tokens] = kv
        self._bytes += _size(kv)
        while self._bytes > self.max_bytes and self._entries:
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= _size(evicted)

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0


def _size(kv: LayerKV) -> int:
    return sum(k.nbytes + v.nbytes for k, v in kv)


def prefill_contexts(
    model, contexts: Sequence[tuple[int, ...]], pad_id: int, device: torch.device, logits_to_keep: bool
) -> list[LayerKV]:
    """Each context's keys and values (`contexts` distinct and non-empty), encoded as one left-padded batch;
    `logits_to_keep`: the model's forward takes that argument (its logits are not used)."""
    input_ids, mask, positions = left_padded(contexts, pad_id, device)
    width = input_ids.shape[1]
    keep = {"logits_to_keep": 1} if logits_to_keep else {}
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True, **keep)
    return [rows_kv(out.past_key_values, i, width - len(c), width) for i, c in enumerate(contexts)]


def left_padded(
    sequences: Sequence[Sequence[int]], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids, attention mask and position ids of `sequences` left-padded to the longest; positions
    count from each row's first token, so padding does not shift RoPE."""
    width = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(sequences), width), dtype=torch.long, device=device)
    for i, sequence in enumerate(sequences):
        input_ids[i, width - len(sequence) :] = torch.tensor(sequence, dtype=torch.long)
        mask[i, width - len(sequence) :] = 1
    return input_ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def rows_kv(cache: Cache, row: int, start: int, end: int) -> LayerKV:
    """Row `row`'s keys and values at cache slots [start, end), copied out of the batch's cache."""
    return [(layer.keys[row, :, start:end].clone(), layer.values[row, :, start:end].clone()) for layer in cache.layers]


def batch_cache(config, contexts: Sequence[LayerKV | None], width: int, capacity: int) -> StaticCache:
    """A cache of `capacity` slots, preallocated (a decode step writes its keys in place, where a growing
    cache copies itself at every step), holding each row's context keys and values in its first `width`
    slots, right-aligned (left padding); None: a row with an empty context."""
    cache = StaticCache(config=config, max_cache_len=capacity)
    if width == 0:
        return cache
    template = next(kv for kv in contexts if kv is not None)
    for layer, (keys0, values0) in enumerate(template):
        heads, _, dim = keys0.shape
        keys = keys0.new_zeros((len(contexts), heads, width, dim))
        values = values0.new_zeros((len(contexts), heads, width, dim))
        for row, kv in enumerate(contexts):
            if kv is not None:
                length = kv[layer][0].shape[1]
                keys[row, :, width - length :] = kv[layer][0]
                values[row, :, width - length :] = kv[layer][1]
        cache.update(keys, values, layer)
    return cache


def keep_rows(cache: Cache, rows: torch.Tensor) -> None:
    """Keep only batch rows `rows` of a cache (its layers' keys and values, copied)."""
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys[rows], layer.values[rows]
