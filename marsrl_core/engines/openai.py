"""The OpenAI-compatible engine: segments decoded by a server fleet (vLLM, SGLang) over HTTP.

Each segment request is one `POST {base_url}/completions` with the prompt as token ids (prompt +
already-decoded prefix), `max_tokens` = the segment length, `logprobs=0` (the sampled token's
log-prob) and `return_token_ids=true` (a vLLM extension) so the new tokens come back as ids, not text.
Requests of one segment are sent concurrently. Start the server with
`--logprobs-mode processed_logprobs` so that log-probs are after temperature, as the learner expects.

Weights: `update_weights(version, checkpoint_folder)` asks a vLLM server to reload them in place
through its development endpoint `POST /collective_rpc` (`method=reload_weights`,
`weights_path=...`; the server needs `VLLM_SERVER_DEV_MODE=1` and must see the same filesystem).
An in-memory state dict cannot cross HTTP and is refused.

Deliberate simplification: no retries or load balancing across servers here; put a balancer in
front of a fleet, or give each rollout process its own server.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from marsrl_core.engines.base import EngineError, SegmentRequest, SegmentResult, derive_seed


class OpenAIEngine:
    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        *,
        tokenizer: Any = None,
        policy_version: int = 0,
        timeout_s: float = 600.0,
        max_concurrency: int = 64,
        stop_strings: Sequence[str] = (),
    ):
        self.base_url = base_url.rstrip("/")
        self.client = httpx.Client(timeout=timeout_s)
        self.tokenizer = tokenizer
        self.policy_version = policy_version
        self.stop_strings = list(stop_strings)
        self.max_concurrency = max_concurrency
        self.model = model or self._first_model()

    def _first_model(self) -> str:
        try:
            response = self.client.get(f"{self.base_url}/models")
            response.raise_for_status()
            return response.json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as err:
            raise EngineError(f"engine.base_url={self.base_url!r}: cannot list models ({err})") from None

    def _one(self, request: SegmentRequest) -> SegmentResult:
        s = request.sampling
        body = {
            "model": self.model,
            "prompt": [int(t) for t in request.prompt_ids] + [int(t) for t in request.prefix_ids],
            "max_tokens": request.max_new_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "top_k": s.top_k,
            "seed": None if s.seed is None else derive_seed(s.seed, len(request.prefix_ids)),
            "logprobs": 0,
            "return_token_ids": True,
            "skip_special_tokens": False,
        }
        if self.stop_strings:
            body["stop"] = self.stop_strings
        try:
            response = self.client.post(f"{self.base_url}/completions", json=body)
        except httpx.HTTPError as err:
            raise EngineError(f"engine.base_url={self.base_url!r}: request failed ({err})") from None
        if response.status_code != 200:
            raise EngineError(f"engine.base_url={self.base_url!r}: HTTP {response.status_code}: {response.text[:300]}")
        choice = response.json()["choices"][0]
        tokens = choice.get("token_ids")
        if tokens is None:
            raise EngineError(
                f"engine.base_url={self.base_url!r}: the server returned no token_ids "
                "(it needs the vLLM extension return_token_ids)"
            )
        logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
        return SegmentResult(list(tokens), logprobs, choice.get("finish_reason") == "stop", self.policy_version)

    def decode_segment(self, requests: Sequence[SegmentRequest]) -> list[SegmentResult]:
        if not requests:
            return []
        with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(requests))) as pool:
            return list(pool.map(self._one, requests))

    def update_weights(self, version: int, weights: Any) -> None:
        if isinstance(weights, dict):
            raise EngineError(
                "engine 'openai': weights must be a checkpoint folder the server can read, not an in-memory state dict"
            )
        root = self.base_url.removesuffix("/v1")
        body = {"method": "reload_weights", "kwargs": {"weights_path": str(Path(weights).resolve())}}
        response = self.client.post(f"{root}/collective_rpc", json=body)
        if response.status_code != 200:
            raise EngineError(
                f"engine.base_url={self.base_url!r}: weight reload failed with HTTP "
                f"{response.status_code} (is VLLM_SERVER_DEV_MODE=1 set?): {response.text[:300]}"
            )
        self.policy_version = version

    def close(self) -> None:
        self.client.close()
