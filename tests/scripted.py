"""A scripted engine for tests: the test chooses each output text from the prompt text.

It implements the real segment interface (prefix continuation, segment limits, EOS) over the tiny
character tokenizer, so everything above it (TextGenerator, the V-C loop, evaluation, the rollout
scheduler) runs unchanged. The script is called once per new output, identified by its prompt and its
sampling seed (each rollout sample has its own seed), so a counting script can vary a group's outputs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from marsrl_core.demo.tiny import build_tiny_tokenizer
from marsrl_core.engines.base import SegmentRequest, SegmentResult


class ScriptedEngine:
    def __init__(
        self, script: Callable[[str], str], delay_s: float = 0.0, before_decode: Callable[[], None] | None = None
    ):
        """`delay_s`: how long each segment batch takes (a real engine's decode is not instant).
        `before_decode`: called before each segment batch (a test holds the decode back with it)."""
        self.tokenizer = build_tiny_tokenizer()
        self.script = script
        self.policy_version = 0
        self.calls: list[str] = []
        self._outputs: dict[tuple, list[int]] = {}
        self.max_positions = None
        self.delay_s = delay_s
        self.before_decode = before_decode

    def decode_segment(self, requests: Sequence[SegmentRequest]) -> list[SegmentResult]:
        if self.before_decode is not None:
            self.before_decode()
        time.sleep(self.delay_s)
        results = []
        for r in requests:
            key = (tuple(r.prompt_ids), r.sampling.seed)
            if not r.prefix_ids or key not in self._outputs:
                prompt = self.tokenizer.decode(list(r.prompt_ids))
                self.calls.append(prompt)
                text = self.script(prompt)
                self._outputs[key] = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [
                    self.tokenizer.eos_token_id
                ]
            full = self._outputs[key]
            start = len(r.prefix_ids)
            piece = full[start : start + r.max_new_tokens]
            results.append(
                SegmentResult(piece, [0.0] * len(piece), start + len(piece) == len(full), self.policy_version)
            )
        return results

    def update_weights(self, version, weights) -> None:
        self.policy_version = version
