"""Concurrent callers share one engine: their segment requests are merged into batches."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from marsrl_core.demo.tiny import build_tiny_model
from marsrl_core.engines.base import SamplingParams, SegmentRequest
from marsrl_core.engines.batching import BatchingEngine
from marsrl_core.engines.hf import HFEngine


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return HFEngine.from_pretrained(build_tiny_model(tmp_path_factory.mktemp("tiny"), max_position_embeddings=128))


def test_concurrent_callers_get_their_own_results_from_merged_batches(engine):
    shared = BatchingEngine(engine, window_s=0.05)
    prompts = [engine.tokenizer(f"S|{i}+{i}|", add_special_tokens=False)["input_ids"] for i in range(8)]
    greedy = SamplingParams(temperature=0)
    alone = [engine.decode_segment([SegmentRequest(p, (), 6, greedy)])[0].token_ids for p in prompts]
    with ThreadPoolExecutor(8) as pool:
        together = list(
            pool.map(lambda p: shared.decode_segment([SegmentRequest(p, (), 6, greedy)])[0].token_ids, prompts)
        )
    assert together == alone
    assert shared.batches < len(prompts) and max(shared.batch_sizes) > 1


def test_errors_reach_every_caller_of_the_batch(engine):
    shared = BatchingEngine(engine)
    with pytest.raises(Exception, match="exceeds the model's context"):
        shared.decode_segment([SegmentRequest([5] * 200, (), 4, SamplingParams(temperature=0))])
    # The engine is usable again afterwards.
    assert len(shared.decode_segment([SegmentRequest([5], (), 2, SamplingParams(temperature=0))])[0].token_ids) == 2


def test_an_older_version_never_replaces_a_newer_one(engine):
    shared = BatchingEngine(engine)
    state = {k: v.clone() for k, v in engine.model.state_dict().items()}
    shared.update_weights(6, state)
    shared.update_weights(5, state)  # a slower scheduler offering an older version
    assert shared.policy_version == 6
