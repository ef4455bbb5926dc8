"""The engine interface: decode one segment for a batch of requests, and take new weights.

An engine is given, per request, the prompt token ids, the already-decoded prefix, sampling
parameters and `max_new_tokens` (the segment length). It returns the new token ids, the log-prob of
each sampled token under the sampling policy, whether the request finished (EOS / stop string) or
filled its segment, and the policy version that produced it. Calling it again with the longer prefix
continues an unfinished output, possibly under a newer policy version.

`generate(...)` drives an engine segment by segment until every request finishes or spends its
budget; `TextGenerator` adds the tokenizer so callers (the V-C loop, evaluation) work in text.

Deliberate simplification: stop strings are checked by the engines on decoded text; EOS is the
tokenizer's `eos_token_id`.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol


def derive_seed(seed: int, *parts: int) -> int:
    """A seed for a sub-stream (a prompt, a call, a segment offset) of `seed`: deterministic, distinct for
    distinct parts, and always below 2**32 (products of seeds overflowed torch's 64-bit seed)."""
    return zlib.crc32(":".join(map(str, (seed, *parts))).encode())


class EngineError(RuntimeError):
    """An engine cannot serve a request; the message names the request and the limit."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None


@dataclass
class SegmentRequest:
    prompt_ids: Sequence[int]
    prefix_ids: Sequence[int] = ()
    max_new_tokens: int = 16
    sampling: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class SegmentResult:
    token_ids: list[int]
    logprobs: list[float]
    finished: bool  # EOS or a stop string inside this segment
    policy_version: int


class Engine(Protocol):
    policy_version: int

    def decode_segment(self, requests: Sequence[SegmentRequest]) -> list[SegmentResult]: ...

    def update_weights(self, version: int, weights: Any) -> None: ...


@dataclass
class Completion:
    """A whole output decoded segment by segment."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str = "length"  # "stop" when finished, "budget" when cut off by max_tokens, "skipped"
    text: str = ""
    prompt_tokens: int = 0

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "budget"

    @property
    def skipped(self) -> bool:
        """Its prompt and budget did not fit the engine's context: nothing was decoded."""
        return self.finish_reason == "skipped"


def generate(
    engine: Engine,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    segment_tokens: int,
    sampling: SamplingParams = SamplingParams(),
    on_segment: Callable[[int, int, int], None] | None = None,
) -> list[Completion]:
    """Decode every prompt to its end (EOS) or `max_tokens`, one batched segment at a time; after each,
    `on_segment(segments, tokens decoded, outputs still decoding)` when given.

    With a seed, prompt i samples under its own seed derived from (seed, i): identical prompts still
    give independent samples, and the same call gives the same outputs again."""
    outputs = [Completion() for _ in prompts]
    per_prompt = [
        sampling if sampling.seed is None else replace(sampling, seed=derive_seed(sampling.seed, i))
        for i in range(len(prompts))
    ]
    active = list(range(len(prompts)))
    segments = tokens = 0
    while active:
        requests = [
            SegmentRequest(
                prompts[i],
                outputs[i].token_ids,
                min(segment_tokens, max_tokens - len(outputs[i].token_ids)),
                per_prompt[i],
            )
            for i in active
        ]
        results = engine.decode_segment(requests)
        still = []
        for i, result in zip(active, results):
            out = outputs[i]
            out.token_ids.extend(result.token_ids)
            out.logprobs.extend(result.logprobs)
            out.versions.extend([result.policy_version] * len(result.token_ids))
            if result.finished:
                out.finish_reason = "stop"
            elif len(out.token_ids) >= max_tokens:
                out.finish_reason = "budget"
            else:
                still.append(i)
        active = still
        segments, tokens = segments + 1, tokens + sum(len(r.token_ids) for r in results)
        if on_segment is not None:
            on_segment(segments, tokens, len(active))
    return outputs


class TextGenerator:
    """An engine plus its tokenizer: prompts in text, completions with text.

    With a seed, each `complete` call samples under its own seed derived from (seed, call number): the
    Corrector's call does not reuse the noise of the Solver's call for the same prompt index (with one
    seed for every call it did, and since a repair is written in the solution's format, token for token,
    it reproduced the solution's mistakes: the demo's fix rate measured 30% instead of about 75%). A
    new generator with the same seed replays the same sequence of calls exactly.
    """

    def __init__(self, engine: Engine, tokenizer: Any, segment_tokens: int, sampling: SamplingParams):
        self.engine, self.tokenizer = engine, tokenizer
        self.segment_tokens, self.sampling = segment_tokens, sampling
        self.calls = 0
        self.context = getattr(engine, "max_positions", None) or getattr(engine, "max_model_len", None)
        self.skipped = 0  # prompts skipped so far for not fitting the context with their budget

    def _next_sampling(self) -> SamplingParams:
        self.calls += 1
        if self.sampling.seed is None:
            return self.sampling
        return replace(self.sampling, seed=derive_seed(self.sampling.seed, self.calls))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def complete(
        self, prompts: Sequence[str], max_tokens: int, on_segment: Callable[[int, int, int], None] | None = None
    ) -> list[Completion]:
        """Each prompt's completion; a prompt that does not fit the engine's context with `max_tokens`
        is skipped (`Completion.skipped`, with its `prompt_tokens`), as rollouts reject one, so that one
        long prompt does not end a whole evaluation. `on_segment` as in `generate`."""
        encoded = [self.encode(p) for p in prompts]
        fits = [i for i, ids in enumerate(encoded) if self.context is None or len(ids) + max_tokens <= self.context]
        decoded = generate(
            self.engine, [encoded[i] for i in fits], max_tokens, self.segment_tokens, self._next_sampling(), on_segment
        )
        outputs = [Completion(finish_reason="skipped", prompt_tokens=len(ids)) for ids in encoded]
        for i, out in zip(fits, decoded):
            out.text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
            out.prompt_tokens = len(encoded[i])
            outputs[i] = out
        self.skipped += len(prompts) - len(fits)
        return outputs


def for_role(generator: TextGenerator | dict[str, TextGenerator], role: str) -> TextGenerator:
    """The generator of `role`: the same one for all roles (shared policy) or one per role."""
    return generator[role] if isinstance(generator, dict) else generator


def complete_as(
    generator: TextGenerator | dict[str, TextGenerator],
    role: str,
    prompts: Sequence[str],
    max_tokens: int,
    progress: Any = None,
    label: str | None = None,
) -> list[Completion]:
    """`role`'s completions of `prompts`, announced to `progress` (a `runtime.progress.Progress`) as
    the phase `label` (default the role) when one is given."""
    if progress is None:
        return for_role(generator, role).complete(prompts, max_tokens)
    progress.phase(label or role, len(prompts))
    return for_role(generator, role).complete(prompts, max_tokens, progress.segment)
