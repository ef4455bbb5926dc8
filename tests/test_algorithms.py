"""Advantages, the PPO-clip loss and chunked log-probs against hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from marsrl_core.learn.algorithms import (
    chunked_logprobs,
    group_advantages,
    importance_weights,
    naive_logprobs,
    policy_loss,
)


def test_group_advantages_by_hand():
    a = group_advantages([1, 0, 0, 1])  # mean 0.5, unbiased std sqrt(1/3)
    assert a == pytest.approx([0.8660254, -0.8660254, -0.8660254, 0.8660254], abs=1e-5)
    assert group_advantages([0, 1]) == pytest.approx([-0.7071068, 0.7071068], abs=1e-5)
    assert group_advantages([1, 1, 1, 1]) is None  # zero variance: dropped
    assert group_advantages([0.0]) is None
    assert group_advantages([1, 0, 0, 0], scale_rewards=False) == pytest.approx([0.75, -0.25, -0.25, -0.25])


def _batch():
    # Three sequences of up to two tokens. Ratios pi/pi_behaviour chosen so that clipping is active
    # above (A, ratio 1.5 > 1.28 with A > 0) and below (B, ratio 0.5 < 0.8 with A < 0).
    ratios = torch.tensor([[1.5, 1.0], [0.5, 0.9], [1.1, 1.0]])
    behaviour = torch.tensor([[-1.0, -2.0], [-0.5, -1.5], [-3.0, -1.0]])
    logprobs = (behaviour + ratios.log()).requires_grad_(True)
    advantages = torch.tensor([1.0, -1.0, 2.0])
    mask = torch.tensor([[1, 1], [1, 1], [1, 0]])
    return logprobs, behaviour, advantages, mask


def test_policy_loss_by_hand():
    logprobs, behaviour, advantages, mask = _batch()
    out = policy_loss(logprobs, behaviour, advantages, mask, epsilon=0.2, epsilon_high=0.28, loss_type="dapo")
    # Per-token losses: A: -min(1.5, 1.28) = -1.28, -1.0; B: -min(-0.5, -0.8) = 0.8, 0.9; C: -2.2.
    assert float(out.loss) == pytest.approx((-1.28 - 1.0 + 0.8 + 0.9 - 2.2) / 5, abs=1e-5)
    assert out.clip_fraction == pytest.approx(2 / 5) and out.clip_high_fraction == pytest.approx(1 / 5)
    assert out.ratio_max == pytest.approx(1.5, abs=1e-5)
    grpo = policy_loss(logprobs, behaviour, advantages, mask, loss_type="grpo")
    assert float(grpo.loss) == pytest.approx(((-2.28 / 2) + (1.7 / 2) + (-2.2)) / 3, abs=1e-5)
    # Clipped tokens pass no gradient; unclipped ones do.
    out.loss.backward()
    g = logprobs.grad
    assert g[0, 0] == 0 and g[1, 0] == 0 and g[0, 1] != 0 and g[1, 1] != 0 and g[2, 1] == 0


def test_on_policy_ratio_is_exactly_one_and_kl_zero_against_itself():
    lp = torch.tensor([[-1.2, -0.3]], requires_grad=True)
    out = policy_loss(
        lp, lp.detach().clone(), torch.tensor([1.0]), torch.ones(1, 2), beta=0.1, ref_logprobs=lp.detach().clone()
    )
    assert out.ratio_mean == 1.0 and out.ratio_max == 1.0 and out.kl == 0.0 and out.clip_fraction == 0.0
    assert float(out.loss) == pytest.approx(-1.0)


def test_truncated_importance_sampling_caps_stale_tokens():
    logprobs, behaviour, advantages, mask = _batch()
    stale = behaviour.clone()
    stale[0, 0] -= math.log(100.0)  # a token 100x more likely now than when it was sampled
    out = policy_loss(logprobs, stale, advantages, mask, tis_cap=2.0)
    # The proximal ratio is 1 everywhere, so each token's loss is -min(w, cap) * A.
    w = torch.exp(logprobs.detach() - stale).clamp(max=2.0)
    expected = -(w * advantages[:, None] * mask).sum() / mask.sum()
    assert float(out.loss) == pytest.approx(float(expected), abs=1e-5)
    assert float(w[0, 0]) == 2.0


def test_importance_weights_per_token_or_sequence_truncated_or_masked():
    # log(pi_prox / pi_behaviour): sequence 0 has ratios 3 and 0.5 (product 1.5), sequence 1 ratios 1.5
    # and 2 (product 3) with its second token padding (its value must not count).
    log_ratio = torch.tensor([[math.log(3.0), math.log(0.5)], [math.log(1.5), math.log(2.0)]])
    mask = torch.tensor([[True, True], [True, False]])
    w = importance_weights(log_ratio, mask, 2.0, "token_truncate")
    assert w[mask].tolist() == pytest.approx([2.0, 0.5, 1.5])
    w = importance_weights(log_ratio, mask, 2.0, "token_mask")
    assert w[mask].tolist() == pytest.approx([0.0, 0.5, 1.5])
    w = importance_weights(log_ratio, mask, 2.0, "sequence_truncate")
    assert w[mask].tolist() == pytest.approx([1.5, 1.5, 1.5])  # sequence 1: 1.5 alone, padding left out
    w = importance_weights(log_ratio, mask, 1.2, "sequence_mask")
    assert w[mask].tolist() == pytest.approx([0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="tis_mode='sequence'"):
        importance_weights(log_ratio, mask, 2.0, "sequence")


def test_dual_clip_bounds_the_loss_of_a_negative_advantage_with_a_large_ratio():
    behaviour = torch.tensor([[-3.0, -1.0]])
    logprobs = (behaviour + torch.tensor([[5.0, 1.1]]).log()).requires_grad_(True)  # ratios 5 and 1.1
    advantages, mask = torch.tensor([-1.0]), torch.ones(1, 2)
    plain = policy_loss(logprobs, behaviour, advantages, mask)
    assert float(plain.loss) == pytest.approx((5.0 + 1.1) / 2, abs=1e-5)  # -min(-r, -clip(r)) = r
    out = policy_loss(logprobs, behaviour, advantages, mask, clip_ratio_c=3.0)
    assert float(out.loss) == pytest.approx((3.0 + 1.1) / 2, abs=1e-5)  # the first token's loss is -A * c
    assert out.dual_clip_fraction == 0.5
    out.loss.backward()
    assert logprobs.grad[0, 0] == 0 and logprobs.grad[0, 1] != 0
    positive = policy_loss(logprobs, behaviour, torch.tensor([1.0]), mask, clip_ratio_c=3.0)
    assert positive.dual_clip_fraction == 0.0  # a positive advantage is never dual-clipped


def test_an_overflowing_log_ratio_or_nan_in_padding_keeps_the_loss_and_gradient_finite():
    behaviour = torch.tensor([[-1000.0, -1.0, float("nan")]])  # a token 1000 nats likelier now; padding NaN
    logprobs = torch.tensor([[-0.1, -1.0, float("nan")]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0]])
    out = policy_loss(logprobs, behaviour, torch.tensor([-1.0]), mask)
    assert math.isfinite(float(out.loss)) and math.isfinite(out.ratio_max)
    out.loss.backward()
    assert torch.isfinite(logprobs.grad).all()
    decoupled = policy_loss(logprobs, behaviour, torch.tensor([-1.0]), mask, tis_cap=2.0, tis_mode="sequence_truncate")
    assert math.isfinite(float(decoupled.loss))


def test_decoupled_rows_use_the_proximal_ratio_and_a_capped_weight_while_others_keep_ppo():
    logprobs, behaviour, advantages, mask = _batch()
    stale = behaviour.clone()
    stale[1] -= math.log(4.0)  # sequence 1 sampled by an old policy: 4x less likely then than now
    rows = torch.tensor([False, True, False])
    out = policy_loss(logprobs, stale, advantages, mask, decoupled=rows)
    ppo = policy_loss(logprobs, stale, advantages, mask)
    # Sequence 1's tokens: ratio 1 against the proximal policy, weight min(ratio to behaviour, 2.0).
    w = torch.exp(logprobs.detach()[1] - stale[1]).clamp(max=2.0)
    per_token_ppo = {(0, 0): -1.28, (0, 1): -1.0, (2, 0): -2.2}
    expected = (sum(per_token_ppo.values()) + float((-w * advantages[1]).sum())) / 5
    assert float(out.loss) == pytest.approx(expected, abs=1e-5)
    assert float(out.loss) != pytest.approx(float(ppo.loss), abs=1e-3)


def test_chunked_logprobs_equal_unchunked():
    torch.manual_seed(0)
    hidden = torch.randn(37, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    targets = torch.randint(0, 50, (37,))
    lp1, ent1 = chunked_logprobs(hidden, weight, targets, chunk_tokens=8, temperature=0.9)
    assert lp1.requires_grad
    lp2, ent2 = naive_logprobs(hidden, weight, targets, temperature=0.9)
    assert torch.allclose(lp1, lp2, atol=1e-5) and torch.allclose(ent1, ent2, atol=1e-5)
    upstream = torch.randn(37)  # any per-token weighting, as the PPO loss applies
    g1 = torch.autograd.grad((lp1 * upstream).sum(), (hidden, weight))
    g2 = torch.autograd.grad((lp2 * upstream).sum(), (hidden, weight))
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(g1, g2))
    assert not ent1.requires_grad  # entropy is a metric
