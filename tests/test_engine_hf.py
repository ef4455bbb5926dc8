"""The transformers engine on a tiny model: segments, log-probs, EOS, weight updates, limits."""

from __future__ import annotations

import gc
import tracemalloc
from dataclasses import replace

import pytest
import torch

from marsrl_core.demo.tiny import build_tiny_model
from marsrl_core.engines.base import EngineError, SamplingParams, SegmentRequest, TextGenerator, generate
from marsrl_core.engines.hf import HFEngine, load_safetensors_state
from marsrl_core.engines.kv_cache import SegmentKVCache

GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), max_position_embeddings=128)


@pytest.fixture
def engine(folder):
    return HFEngine.from_pretrained(folder)


def _ids(engine, *texts):
    return [engine.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def test_segments_continue_exactly_like_one_call(engine):
    prompts = _ids(engine, "S|1+2|", "S|3+4+5+6+7|", "V|9|")  # different lengths: left padding matters
    whole = generate(engine, prompts, 30, 30, GREEDY)
    pieces = generate(engine, prompts, 30, 7, GREEDY)
    for a, b in zip(whole, pieces):
        assert a.token_ids == b.token_ids
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_equal_a_separate_forward_pass(engine, temperature):
    prompts = _ids(engine, "S|1+2|", "C|5+5|x|y|")
    outs = generate(engine, prompts, 20, 6, SamplingParams(temperature=temperature, seed=1))
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt + out.token_ids])
        with torch.no_grad():
            logits = engine.model(ids).logits[0].float() / (temperature or 1.0)
        logprobs = torch.log_softmax(logits, -1)
        ref = [float(logprobs[len(prompt) - 1 + j, t]) for j, t in enumerate(out.token_ids)]
        assert max(abs(a - b) for a, b in zip(ref, out.logprobs)) < 1e-4


def test_a_prefill_projects_only_the_last_position_onto_the_vocabulary(engine):
    """Sampling needs the last position's logits; at a prefill of 2 x 12 prompt tokens the output layer
    sees 2 positions, not 24, and what is sampled is the same as from every position's logits."""
    shapes = []
    hook = engine.model.get_output_embeddings().register_forward_hook(lambda m, i, out: shapes.append(out.shape))
    prompts = _ids(engine, "S|1+2+3+4+5|", "S|9+8+7+6+5|")
    sampling = SamplingParams(temperature=1.0, seed=5)
    requests = [SegmentRequest(p, (), 6, sampling) for p in prompts]
    try:
        last_only = engine.decode_segment(requests)
        assert shapes[0][:2] == (2, 1) and len(prompts[0]) > 1
        engine.last_logits_only = False
        every = engine.decode_segment(requests)
        # the prefill encodes each prompt but its last token, which the first decode step feeds
        assert shapes[len(shapes) // 2][:2] == (2, max(len(p) for p in prompts) - 1)
    finally:
        hook.remove()
        engine.last_logits_only = True
    for a, b in zip(last_only, every):
        assert a.token_ids == b.token_ids
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-6)


def test_eos_inside_a_segment_finishes_the_request(engine):
    prompt = _ids(engine, "S|1+2|")[0]
    free = engine.decode_segment([SegmentRequest(prompt, (), 10, GREEDY)])[0]
    assert not free.finished and len(free.token_ids) == 10  # a random model never says EOS
    # Declare the 4th greedy token the end-of-sequence token: decoding must stop right there.
    engine.eos_id = free.token_ids[3]
    first = free.token_ids.index(engine.eos_id)
    stopped = engine.decode_segment([SegmentRequest(prompt, (), 10, GREEDY)])[0]
    assert stopped.finished
    assert stopped.token_ids == free.token_ids[: first + 1]


def test_weight_update_changes_output_and_version(engine, folder, tmp_path):
    prompts = _ids(engine, "S|1+2|")
    before = engine.decode_segment([SegmentRequest(prompts[0], (), 12, GREEDY)])[0]
    other = build_tiny_model(tmp_path / "other", max_position_embeddings=128, seed=7)
    engine.update_weights(3, load_safetensors_state(other))
    after = engine.decode_segment([SegmentRequest(prompts[0], (), 12, GREEDY)])[0]
    assert before.policy_version == 0 and after.policy_version == 3
    assert after.token_ids != before.token_ids
    engine.update_weights(4, folder)  # from a checkpoint folder: back to the first weights
    again = engine.decode_segment([SegmentRequest(prompts[0], (), 12, GREEDY)])[0]
    assert again.token_ids == before.token_ids and again.policy_version == 4


def test_reloading_weights_from_a_folder_keeps_no_python_memory(engine, folder):
    """A rollout reloads the weights at every policy version, for days: each reload must leave nothing
    behind (safetensors 0.8.0's default mmap reader kept ~1.2 KB per file opened)."""
    for version in range(300):  # warm-up (the reader's caches grow ~30 KB over the first few thousand)
        engine.update_weights(version, folder)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for version in range(300, 600):
            engine.update_weights(version, folder)
        gc.collect()
        kept_per_reload = (tracemalloc.get_traced_memory()[0] - before) / 300
    finally:
        tracemalloc.stop()
    assert engine.policy_version == 599
    # 70-120 bytes with the pread reader (a cache still filling up); 1,180-1,280 with the mmap reader
    assert kept_per_reload < 400, f"{kept_per_reload:.0f} bytes of Python objects kept per weight reload"


def test_request_longer_than_context_is_a_clear_error(engine):
    long_prompt = [5] * 120
    with pytest.raises(EngineError, match="request 1: .* exceeds the model's context of 128"):
        engine.decode_segment([SegmentRequest([5], (), 4, GREEDY), SegmentRequest(long_prompt, (), 16, GREEDY)])


def test_bad_checkpoints_and_folders(tmp_path, folder):
    with pytest.raises(EngineError, match="no .safetensors"):
        load_safetensors_state(tmp_path)
    cut = tmp_path / "cut"
    cut.mkdir()
    data = (folder / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(EngineError, match="cannot be read"):
        load_safetensors_state(cut)
    with pytest.raises(EngineError, match="not found or has no config.json"):
        HFEngine.from_pretrained(tmp_path / "missing")


def test_seeded_sampling_is_reproducible_and_independent_per_prompt(engine):
    prompts = _ids(engine, "S|1+2|", "S|1+2|")  # the same prompt twice, as k samples of one problem
    hot = SamplingParams(temperature=1.0, seed=11)
    first = generate(engine, prompts, 24, 5, hot)
    again = generate(engine, prompts, 24, 5, hot)
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    assert first[0].token_ids != first[1].token_ids


def test_text_generator_calls_sample_independently_and_replay(engine):
    # The Solver's call and the Corrector's call on the same prompt index must not share their noise
    # (when they did, repairs reproduced the solutions' mistakes token for token).
    def calls(gen):
        return [[o.token_ids for o in gen.complete(["S|1+2|"] * 4, 24)] for _ in range(3)]

    hot = SamplingParams(temperature=1.0, seed=5)
    first = calls(TextGenerator(engine, engine.tokenizer, 6, hot))
    assert first[0] != first[1] and first[1] != first[2]
    assert calls(TextGenerator(engine, engine.tokenizer, 6, hot)) == first


@pytest.mark.parametrize("seed", [1, 12345, 2**62])
def test_any_seed_samples(engine, seed):
    # Derived seeds stay below 2**32: products of seeds once overflowed torch's seed for any seed >= 1.
    gen = TextGenerator(engine, engine.tokenizer, 5, SamplingParams(temperature=1.0, seed=seed))
    assert all(len(o.token_ids) == 12 or o.finish_reason == "stop" for o in gen.complete(["S|1+2|"] * 3, 12))


def test_weight_update_from_a_checkpoint_with_tied_embeddings(tmp_path):
    from transformers import LlamaForCausalLM

    from marsrl_core.demo.tiny import build_tiny_tokenizer, tiny_llama_config

    tok = build_tiny_tokenizer()
    config = tiny_llama_config(
        len(tok),
        64,
        1,
        2,
        intermediate_size=128,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    for seed, name in ((0, "a"), (1, "b")):
        torch.manual_seed(seed)
        LlamaForCausalLM(config).save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    engine = HFEngine.from_pretrained(tmp_path / "a")
    reference = HFEngine.from_pretrained(tmp_path / "b")
    engine.update_weights(1, tmp_path / "b")  # lm_head is not in the file: it is the embedding matrix
    prompt = [5, 6, 7]
    got = engine.decode_segment([SegmentRequest(prompt, (), 8, GREEDY)])[0]
    want = reference.decode_segment([SegmentRequest(prompt, (), 8, GREEDY)])[0]
    assert got.token_ids == want.token_ids and got.policy_version == 1


def _positions_encoded(engine):
    """A list that collects, per forward pass, how many positions the model encoded (batch x width)."""
    seen: list[int] = []
    hook = engine.model.get_input_embeddings().register_forward_hook(
        lambda m, i, out: seen.append(out.shape[0] * out.shape[1])
    )
    return seen, hook


def test_a_samples_next_segment_starts_from_its_kept_keys_and_values(folder):
    """Segments continued from the kept keys and values decode what re-encoding the prefix decodes, and
    encode only the new tokens: each later segment's rows are all hits, with no prefill."""
    cached, fresh = HFEngine.from_pretrained(folder), HFEngine.from_pretrained(folder, kv_cache_mb=0)
    cached.eos_id = fresh.eos_id = -1  # every output runs its 30 tokens
    prompts = _ids(cached, "S|1+2|", "S|3+4+5+6+7|", "V|9|")
    hot = SamplingParams(temperature=1.0, seed=3)
    seen, hook = _positions_encoded(cached)
    try:
        with_cache = generate(cached, prompts, 30, 7, hot)
    finally:
        hook.remove()
    without = generate(fresh, prompts, 30, 7, hot)
    for a, b in zip(with_cache, without):
        assert a.token_ids == b.token_ids and len(a.token_ids) == 30
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)
    segments = 5  # 30 tokens in segments of 7
    assert cached.kv_cache.hits == 3 * (segments - 1) and fresh.kv_cache.hits == 0
    # One prefill (the first segment's), then one position per row and step: 3 rows x 30 tokens.
    assert len(seen) == 1 + 30 and sum(seen[1:]) == 3 * 30
    # The engine cannot tell a spent budget from a segment's end: each output's last entry stays until
    # evicted or the next weight load empties the cache.
    assert len(cached.kv_cache) == 3


def test_rows_that_share_a_prompt_are_prefilled_once(engine):
    """A group's samples share their prompt: the segment's prefill encodes it once, and each row samples
    as it would alone."""
    prompt, other = _ids(engine, "S|1+2+3|", "V|4+4|x|")
    requests = [SegmentRequest(prompt, (), 5, SamplingParams(temperature=1.0, seed=i)) for i in range(4)]
    requests.append(SegmentRequest(other, (), 5, SamplingParams(temperature=1.0, seed=9)))
    seen, hook = _positions_encoded(engine)
    try:
        together = engine.decode_segment(requests)
    finally:
        hook.remove()
    assert seen[0] == 2 * (max(len(prompt), len(other)) - 1)  # two distinct contexts, not five rows
    alone = [engine.decode_segment([r])[0] for r in requests]
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert len({tuple(r.token_ids) for r in together[:4]}) > 1  # the shared prompt's samples still differ


def test_new_weights_empty_the_kv_cache(engine, folder, tmp_path):
    """Keys and values of the old weights are never continued: after a weight load the next segment
    decodes what an engine holding only the new weights decodes from the same prefix."""
    prompt = _ids(engine, "S|1+2|")[0]
    first = engine.decode_segment([SegmentRequest(prompt, (), 6, GREEDY)])[0]
    assert len(engine.kv_cache) == 1
    other = build_tiny_model(tmp_path / "other", max_position_embeddings=128, seed=7)
    engine.update_weights(1, other)
    assert len(engine.kv_cache) == 0
    got = engine.decode_segment([SegmentRequest(prompt, first.token_ids, 6, GREEDY)])[0]
    want = HFEngine.from_pretrained(other).decode_segment([SegmentRequest(prompt, first.token_ids, 6, GREEDY)])[0]
    assert got.token_ids == want.token_ids and got.policy_version == 1


def test_the_kv_cache_evicts_the_oldest_entries_past_its_budget():
    def entry(tokens: int):
        return [(torch.zeros(2, tokens, 4), torch.zeros(2, tokens, 4))]  # 2 x 2 x tokens x 4 floats

    cache = SegmentKVCache(max_bytes=3 * 64 * 10)  # three entries of 10 tokens
    for key in range(4):
        cache.put((key,), entry(10))
    assert len(cache) == 3 and cache.take((0,)) is None  # the oldest went
    assert cache.take((3,)) is not None and cache.take((3,)) is None  # an entry is used once
    assert (cache.hits, cache.misses) == (1, 2)
    cache.put((5,), entry(40))  # larger than the budget on its own: nothing is kept
    assert len(cache) == 0
    off = SegmentKVCache(max_bytes=0)
    off.put((1,), entry(1))
    assert len(off) == 0


def test_a_batch_drops_its_ended_rows_and_decodes_the_rest_as_alone(folder):
    """Rows that end early (a short segment, or EOS) leave the batch; the rows still decoding, and the
    next segments continued from the kept contexts, sample what each would alone, re-encoded."""
    engine, alone = HFEngine.from_pretrained(folder), HFEngine.from_pretrained(folder, kv_cache_mb=0)
    prompts = _ids(engine, "S|1+2|", "S|3+4+5|", "V|9|x|", "C|1|y|z|", "S|7+7+7+7|", "V|2+2|")
    budgets = [3, 5, 12, 12, 4, 12]  # three rows end before the others: the batch drops them
    shapes: list[int] = []
    hook = engine.model.get_input_embeddings().register_forward_hook(lambda m, i, out: shapes.append(out.shape[0]))
    outputs: list[list[int]] = [[] for _ in prompts]
    try:
        for _ in range(2):  # a second segment continues each row from its kept context
            requests = [
                SegmentRequest(p, o, b, SamplingParams(temperature=1.0, seed=k))
                for k, (p, o, b) in enumerate(zip(prompts, outputs, budgets))
            ]
            together = engine.decode_segment(requests)
            single = [alone.decode_segment([r])[0] for r in requests]
            for output, a, b in zip(outputs, together, single):
                assert a.token_ids == b.token_ids and a.finished == b.finished
                assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)
                output.extend(a.token_ids)
    finally:
        hook.remove()
    assert min(shapes) < len(prompts)  # some token steps ran on fewer rows than the batch
    assert engine.kv_cache.hits > 0


def test_a_sliding_window_model_decodes_its_rows_whole(tmp_path):
    """A sliding-window layer's cache holds only its window, so no context is kept or joined: left-padded
    rows, ended rows dropped, still decode what one token at a time over the whole sequence decodes."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from marsrl_core.demo.tiny import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    shape = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2}
    config = Qwen2Config(
        vocab_size=len(tok),
        num_key_value_heads=2,
        max_position_embeddings=128,
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=0,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **shape,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    engine = HFEngine(model, tok)
    assert not engine.keeps_contexts
    engine.eos_id = -1
    prompts, budgets = [list(range(5, 17)), [20, 21, 22], [30, 31, 32, 33, 34]], [4, 14, 14]
    outputs: list[list[int]] = [[] for _ in prompts]
    for _ in range(2):
        requests = [
            SegmentRequest(p, o, b - len(o), GREEDY) for p, o, b in zip(prompts, outputs, budgets) if len(o) < b
        ]
        live = [o for o, b in zip(outputs, budgets) if len(o) < b]
        for output, result in zip(
            live, engine.decode_segment([replace(r, max_new_tokens=min(r.max_new_tokens, 7)) for r in requests])
        ):
            output.extend(result.token_ids)
    for prompt, output, budget in zip(prompts, outputs, budgets):
        ids = list(prompt)
        for _ in range(len(output)):
            with torch.no_grad():
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        assert output == ids[len(prompt) :] and len(output) == min(budget, 14)
    assert len(engine.kv_cache) == 0
