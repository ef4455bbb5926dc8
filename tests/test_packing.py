"""Padding-free micro-batches (`learner.padding_free`): one row, `position_ids` restarting for each
sequence, attention confined to each (transformers' block-diagonal mask with sdpa and eager, or
`attention.VARLEN_SDPA`, which the learner uses). Exactly what the padded rows give, for the tiny
Llama and a random Qwen3, and through a learner step; micro-batches balanced in tokens; and how
sequence parallelism cuts a row (its two- and four-rank steps are in tests/test_distributed.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3ForCausalLM

from marsrl_core.config import load_config
from marsrl_core.demo.tiny import build_tiny_model, tiny_llama_config
from marsrl_core.engines.hf import HFEngine
from marsrl_core.learn.attention import VARLEN_SDPA
from marsrl_core.learn.learner import Learner
from marsrl_core.learn.scoring import PackedBatch, TokenScorer
from marsrl_core.learn.sequence_parallel import SequenceGroup, check_heads, local_part
from marsrl_core.store import SegmentStore
from tests.qwen3 import qwen3_config
from tests.rollout_helpers import digit_fraction, sample_groups

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), max_position_embeddings=128, seed=0)


def _sequences(seed: int = 0):
    """Three prompts and responses of different lengths (one response a single token)."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(5, 90, n) for n in (7, 3, 12)]
    responses = [rng.integers(5, 90, n) for n in (5, 9, 1)]
    return prompts, responses


def _qwen3():
    """A random Qwen3 of the tests' small shape (`tests/qwen3.py`), with Qwen3's q/k norms."""
    torch.manual_seed(0)
    return Qwen3ForCausalLM(qwen3_config())


def test_a_padding_free_row_holds_only_the_sequences_with_restarting_positions():
    prompts, responses = _sequences()
    batch = PackedBatch.build(prompts, responses, CPU, padding_free=True)
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    assert batch.input_ids.shape == (1, sum(lengths)) and batch.attention_mask is None
    assert batch.position_ids[0].tolist() == [i for n in lengths for i in range(n)]
    # Each response token is predicted from the position just before it, in its own sequence.
    row = batch.input_ids[0]
    assert torch.equal(row[batch.positions + 1], batch.targets)
    assert batch.lengths == [len(r) for r in responses]


@pytest.mark.parametrize("attention", ["sdpa", "eager", VARLEN_SDPA])
@pytest.mark.parametrize("model_kind", ["tiny", "qwen3"])
def test_padding_free_log_probs_equal_the_padded_ones_and_each_sequence_alone(folder, model_kind, attention):
    model = AutoModelForCausalLM.from_pretrained(folder) if model_kind == "tiny" else _qwen3()
    scorer = TokenScorer(model, 4, 1.0)  # chunks smaller than a sequence: the chunking is exercised too
    prompts, responses = _sequences()
    with torch.no_grad():
        model.config._attn_implementation = "sdpa"  # padded rows, and each sequence alone
        padded, padded_entropy = scorer(PackedBatch.build(prompts, responses, CPU))
        alone = [scorer(PackedBatch.build([p], [r], CPU))[0][0] for p, r in zip(prompts, responses)]
        model.config._attn_implementation = attention
        free, free_entropy = scorer(PackedBatch.build(prompts, responses, CPU, padding_free=True))
    assert torch.allclose(free, padded, atol=1e-5) and torch.allclose(free_entropy, padded_entropy, atol=1e-5)
    for row, single, r in zip(free, alone, responses):  # no attention across sequences of the row
        assert torch.allclose(row[: len(r)], single, atol=1e-5)
    # Without the restarting positions the row is one long sequence: the later ones attend to the earlier.
    joined = PackedBatch.build(prompts, responses, CPU, padding_free=True)
    joined.position_ids = torch.arange(joined.input_ids.shape[1])[None]
    joined.cu_seqlens = torch.tensor([0, joined.input_ids.shape[1]], dtype=torch.int32)
    with torch.no_grad():
        assert not torch.allclose(scorer(joined)[0], padded, atol=1e-3)


@pytest.mark.parametrize(("free", "budget"), [(True, 40), (False, 100_000), (True, 100_000)])
def test_a_learner_step_has_the_same_losses_and_gradients_however_it_is_laid_out(folder, tmp_path, free, budget):
    """The same stored groups of two agents through two learners: padded rows in micro-batches of 40
    tokens (several per agent), against padding free and/or one micro-batch per agent. The same losses
    and the same gradients: the layout and the cut change no number. (Compared before AdamW: its first
    step moves a weight by about the learning rate whatever the gradient's size, so a gradient near zero
    that differs in its last bits may move its weight the other way.)"""
    from marsrl_core.learn.agent_loss import train_items

    overrides = [f"store.catalog_url=sqlite:{tmp_path}/lake.sqlite", f"store.data_path={tmp_path}/data"]
    overrides += ["rollout.temperature=1.0"]
    engine = HFEngine.from_pretrained(folder)
    store = SegmentStore(f"sqlite:{tmp_path}/lake.sqlite", f"{tmp_path}/data")
    groups = []
    for agent, prompt, tokens in (("solver", "S|", 12), ("verifier", "V|1+2|", 6)):
        groups += sample_groups(
            engine, store, "r", agent, prompt, groups=2, size=3, reward_fn=digit_fraction, max_tokens=tokens
        )
    samples = store.load_samples("r", [sid for g in groups for sid in g.sample_ids])
    grads, losses = {}, {}
    for variant, (padding_free, tokens) in {"base": (False, 40), "other": (free, budget)}.items():
        layout = [f"learner.padding_free={str(padding_free).lower()}", f"learner.micro_batch_tokens={tokens}"]
        cfg = load_config("tiny", None, overrides + layout)
        learner = Learner(cfg, store, "r", folder, tmp_path / f"ckpt-{variant}", engine.tokenizer)
        per_agent, _ = train_items(groups, samples, cfg.learner)
        seen = []  # what each forward of the decoder got: rows and whether it had an attention mask
        decoder = learner.models["policy"].get_decoder()
        hook = decoder.register_forward_pre_hook(
            lambda _, args, kwargs, seen=seen: seen.append(
                (kwargs["input_ids"].shape[0], kwargs["attention_mask"] is None)
            ),
            with_kwargs=True,
        )
        metrics = learner._accumulate_gradients(per_agent)
        hook.remove()
        assert len(seen) == (2 if tokens > 1000 else len(seen)) > 1, seen  # one micro-batch per agent, or several
        assert all(rows == 1 and unmasked for rows, unmasked in seen) == padding_free, seen
        losses[variant] = {agent: m["loss"] for agent, m in metrics.items()}
        grads[variant] = {n: p.grad.clone() for n, p in learner.models["policy"].named_parameters()}
    assert losses["other"].keys() == losses["base"].keys() == {"solver", "verifier"}
    for agent, loss in losses["base"].items():
        assert losses["other"][agent] == pytest.approx(loss, abs=1e-6)
    assert max(float(g.abs().max()) for g in grads["base"].values()) > 1e-3  # a gradient worth comparing
    for name, grad in grads["base"].items():
        assert torch.allclose(grads["other"][name], grad, atol=1e-6, rtol=1e-4), name


@pytest.mark.parametrize("seed", range(5))
def test_micro_batches_are_as_few_as_fit_and_balanced_in_tokens(seed):
    """64 log-normal lengths (median about an eighth of the longest), a budget of twice the longest:
    every sample in exactly one micro-batch, none over the budget, as few micro-batches as the tokens
    need, their tokens within 5% of the budget of each other; a sample over the budget alone."""
    from types import SimpleNamespace

    from marsrl_core.learn.agent_loss import pack

    rng = np.random.default_rng(seed)
    lengths = np.minimum(rng.lognormal(np.log(1000), 0.9, 64).astype(int) + 1, 8000)
    items = [
        SimpleNamespace(sample=SimpleNamespace(prompt_tokens=np.zeros(n % 7), token_ids=np.zeros(n - n % 7)))
        for n in lengths
    ]
    budget = 2 * int(lengths.max())
    batches = pack(items, budget)
    loads = [sum(len(i.sample.prompt_tokens) + len(i.sample.token_ids) for i in b) for b in batches]
    assert sorted(id(i) for b in batches for i in b) == sorted(id(i) for i in items)
    assert max(loads) <= budget and len(batches) == -(-int(lengths.sum()) // budget)
    assert max(loads) - min(loads) <= 0.05 * budget
    order = {id(item): k for k, item in enumerate(items)}
    for b in batches:  # the samples keep their order within a micro-batch
        assert [order[id(i)] for i in b] == sorted(order[id(i)] for i in b)
    big = SimpleNamespace(sample=SimpleNamespace(prompt_tokens=np.zeros(5), token_ids=np.zeros(3 * budget)))
    assert [len(b) for b in pack([items[0], big, items[1]], budget)] == [1, 2]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("attention", ["flash_attention_2", VARLEN_SDPA])
def test_padding_free_log_probs_on_cuda_equal_the_padded_ones(folder, attention):
    """On a GPU in bf16: the padding-free row through FlashAttention-2's variable-length kernel (where
    `flash_attn` is installed) or the per-sequence kernel gives the padded rows' log-probs and gradients."""
    if attention == "flash_attention_2":
        pytest.importorskip("flash_attn", reason="FlashAttention-2 is not installed")
    cuda = torch.device("cuda")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(cuda)
    scorer = TokenScorer(model, 4, 1.0)
    prompts, responses = _sequences()
    results = []
    for implementation, free in (("sdpa", False), (attention, True)):
        model.config._attn_implementation = implementation
        model.zero_grad(set_to_none=True)
        logprobs, _ = scorer(PackedBatch.build(prompts, responses, cuda, padding_free=free))
        mask = torch.zeros_like(logprobs)
        for row, r in enumerate(responses):
            mask[row, : len(r)] = 1.0
        (logprobs * mask).sum().backward()
        results.append((logprobs * mask, {n: p.grad.float() for n, p in model.named_parameters()}))
    (padded, padded_grads), (free, free_grads) = results
    assert torch.allclose(free, padded, atol=3e-2)
    for name, grad in padded_grads.items():
        assert torch.allclose(free_grads[name], grad, atol=3e-2, rtol=3e-2), name


def test_the_varlen_kernel_refuses_a_batch_that_is_not_one_padding_free_row(folder):
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation=VARLEN_SDPA)
    prompts, responses = _sequences()
    with pytest.raises(ValueError, match=rf"{VARLEN_SDPA}: attention over one padding-free row .* 3 rows"):
        TokenScorer(model, 1024, 1.0)(PackedBatch.build(prompts, responses, CPU))


@pytest.mark.parametrize("size", [2, 4, 64])
def test_sequence_parallel_cuts_a_row_into_equal_parts_with_its_own_padding_sequence(size):
    """Each of `size` ranks gets as many tokens of the row (37 tokens; 64 ranks: more ranks than tokens),
    the row padded at its end by a sequence of its own; the predicting hidden states and their targets
    are split among the ranks in order, and every rank knows how many each scores."""
    prompts, responses = _sequences()
    batch = PackedBatch.build(prompts, responses, CPU, padding_free=True)
    n = batch.input_ids.shape[1]
    parts = [local_part(batch, SequenceGroup(None, rank, size)) for rank in range(size)]
    width = -(-n // size)
    pad = width * size - n
    assert all(part.input_ids.shape == (1, width) for part, _ in parts)
    row = torch.cat([part.input_ids for part, _ in parts], dim=1)[0]
    assert torch.equal(row[:n], batch.input_ids[0]) and not row[n:].any()
    positions = torch.cat([part.position_ids for part, _ in parts], dim=1)[0]
    assert positions.tolist() == batch.position_ids[0].tolist() + list(range(pad))
    for part, counts in parts:
        assert part.cu_seqlens.tolist() == batch.cu_seqlens.tolist() + ([n + pad] if pad else [])
        assert counts == parts[0][1] and sum(counts) == len(batch.targets)
    for rank, (part, counts) in enumerate(parts):
        assert len(part.targets) == counts[rank]
        # each target is the token after its predicting position, which may lie on the next rank
        assert torch.equal(row[part.positions + rank * width + 1], part.targets)
    assert torch.equal(torch.cat([part.targets for part, _ in parts]), batch.targets)


def test_sequence_parallel_refuses_what_it_cannot_cut():
    with pytest.raises(ValueError, match="must divide the model's 3 attention heads"):
        check_heads(tiny_llama_config(100, hidden_size=48, num_heads=3), 2)
    with pytest.raises(ValueError, match="sequence_parallel=2 cuts padding-free rows: set learner.padding_free"):
        load_config("tiny", None, ["learner.sequence_parallel=2"])
    with pytest.raises(ValueError, match="sequence_parallel=2 must divide nproc=3"):
        load_config("tiny", None, ["learner.sequence_parallel=2", "learner.padding_free=true", "learner.nproc=3"])
    with pytest.raises(ValueError, match="must divide the learner's ranks, 1"):
        SequenceGroup.form(None, 2)
