"""GRPO's parts against direct NumPy implementations (TRL's ``GRPOTrainer``): group
advantages, the clipped policy loss with the k3 KL term under each averaging (values and
gradients; float64 NumPy, float32 JAX: relative 1e-5 on values, 1e-3 on gradients against
central differences), micro-batches adding up to the whole batch's value, and the reward
functions (built-ins, TRL's signature, failures named)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zjax.errors import ConfigError
from zjax.rl import (
    RewardError,
    Rewards,
    RLConfig,
    exact_answer,
    format_reward,
    group_advantages,
    policy_loss,
)


def _numpy_advantages(rewards, g, scale):
    r = np.asarray(rewards, np.float64).reshape(-1, g)
    adv = r - r.mean(1, keepdims=True)
    return (adv / (r.std(1, ddof=1)[:, None] + 1e-4) if scale else adv).reshape(-1)


@pytest.mark.parametrize("scale", [True, False])
def test_group_advantages_are_trls(scale):
    rewards = np.random.default_rng(0).integers(0, 3, 24).astype(float)
    adv, std = group_advantages(rewards, 4, scale=scale)
    np.testing.assert_allclose(adv, _numpy_advantages(rewards, 4, scale), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(std, rewards.reshape(-1, 4).std(1, ddof=1), rtol=1e-6)


def _numpy_loss(logp, old, adv, mask, ref, *, beta, eps, loss, max_len):
    """TRL's ``_compute_loss``, written out (float64)."""
    ratio = np.exp(logp - old)
    per = -np.minimum(ratio * adv[:, None], np.clip(ratio, 1 - eps, 1 + eps) * adv[:, None])
    if beta:
        per = per + beta * (np.exp(ref - logp) - (ref - logp) - 1)
    if loss == "grpo":
        return ((per * mask).sum(-1) / np.maximum(mask.sum(-1), 1)).mean()
    if loss == "dr_grpo":
        return (per * mask).sum() / (per.shape[0] * max_len)
    return (per * mask).sum() / mask.sum()


def _inputs(seed, b=6, t=7):
    rng = np.random.default_rng(seed)
    logp = -rng.uniform(0.1, 3, (b, t))
    old = logp + rng.normal(0, 0.3, (b, t))  # off-policy: some ratios leave the clip range
    ref = logp + rng.normal(0, 0.5, (b, t))
    adv = rng.normal(0, 1, b)
    lengths = rng.integers(1, t + 1, b)
    mask = (np.arange(t)[None, :] < lengths[:, None]).astype(float)
    return logp, old, adv, mask, ref


def _jax_value(logp, old, adv, mask, ref, **kw):
    f = lambda x: jnp.asarray(x, jnp.float32)
    out = policy_loss(f(logp), f(old), f(adv), f(mask), ref_logps=f(ref), **kw)
    return out.loss_sum / out.count, out


@pytest.mark.parametrize("loss", ["grpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_the_policy_loss_is_trls_values_and_gradients(loss, beta):
    logp, old, adv, mask, ref = _inputs(1)
    kw = dict(kl_beta=beta, epsilon=0.2, loss=loss, max_new_tokens=9)
    np_kw = dict(beta=beta, eps=0.2, loss=loss, max_len=9)
    got, out = _jax_value(logp, old, adv, mask, ref, **kw)
    assert float(got) == pytest.approx(_numpy_loss(logp, old, adv, mask, ref, **np_kw),
                                       rel=1e-5)
    grad = jax.grad(lambda x: _jax_value(x, old, adv, mask, ref, **kw)[0])(
        jnp.asarray(logp, jnp.float32))
    h, numeric = 1e-6, np.zeros_like(logp)
    for idx in np.ndindex(logp.shape):
        d = np.zeros_like(logp)
        d[idx] = h
        numeric[idx] = (_numpy_loss(logp + d, old, adv, mask, ref, **np_kw)
                        - _numpy_loss(logp - d, old, adv, mask, ref, **np_kw)) / (2 * h)
    np.testing.assert_allclose(np.asarray(grad), numeric, rtol=1e-3, atol=1e-6)
    # metrics: TRL's kl (masked mean) and clip ratio (the clipped term was the minimum)
    ratio = np.exp(logp - old)
    clipped = ((ratio < 0.8) & (adv[:, None] < 0)) | ((ratio > 1.2) & (adv[:, None] > 0))
    assert float(out.clipped_sum / out.tokens) == pytest.approx(
        (clipped * mask).sum() / mask.sum(), rel=1e-6)
    if beta:
        k3 = np.exp(ref - logp) - (ref - logp) - 1
        assert float(out.kl_sum / out.tokens) == pytest.approx((k3 * mask).sum() / mask.sum(),
                                                               rel=1e-5)


@pytest.mark.parametrize("loss", ["grpo", "dr_grpo", "dapo"])
def test_micro_batches_add_up_to_the_whole_batch(loss):
    """zjax sums (loss, count) over micro-batches and devices, then divides: that must be
    TRL's value on the whole batch, for each averaging."""
    logp, old, adv, mask, ref = _inputs(2, b=8)
    kw = dict(kl_beta=0.04, loss=loss, max_new_tokens=7)
    whole, _ = _jax_value(logp, old, adv, mask, ref, **kw)
    parts = [_jax_value(logp[s], old[s], adv[s], mask[s], ref[s], **kw)[1]
             for s in (slice(0, 3), slice(3, 8))]
    total = sum(p.loss_sum for p in parts) / sum(p.count for p in parts)
    assert float(total) == pytest.approx(float(whole), rel=1e-6)


def test_on_policy_the_loss_is_the_policy_gradient():
    """With old = new log-probs, the ratio is 1 and the gradient is -A / |o| per token."""
    logp, _, adv, mask, ref = _inputs(3)
    grad = jax.grad(lambda x: _jax_value(x, jax.lax.stop_gradient(x), adv, mask, ref,
                                         loss="grpo")[0])(jnp.asarray(logp, jnp.float32))
    want = -adv[:, None] * mask / mask.sum(1, keepdims=True) / len(adv)
    np.testing.assert_allclose(np.asarray(grad), want, rtol=1e-5, atol=1e-7)


def test_exact_answer_reads_the_boxed_or_last_number():
    completions = ["so it is \\boxed{12}", "7 + 5 = 12.", "about 1,200 apples",
                   "12 or 13", "no number", [{"role": "assistant", "content": "It is 12."}]]
    answers = ["12", "12", "1200", "12", "12", "12"]
    assert exact_answer([""] * 6, completions, answer=answers) == [1, 1, 1, 0, 0, 1]
    assert exact_answer([""], ["x"], answer=[None]) == [None]
    assert format_reward(["", ""], ["<think>a\nb</think> <answer>1</answer>", "1"]) == [1, 0]


def test_rewards_weigh_and_skip_none_as_trl():
    rewards = Rewards(["tests.rl_user_rewards:length_reward",
                       "tests.rl_user_rewards:only_some"], [0.5, 2.0])
    total, means = rewards(["p"] * 3, ["ab", "abcd", ""], {"answer": ["1", None, "2"]})
    np.testing.assert_allclose(total, [0.5 * 2 + 2, 0.5 * 4, 0 + 2])
    assert means == {"rewards/length_reward": 2.0, "rewards/only_some": 1.0}


@pytest.mark.parametrize("name,says", [
    ("raises", "raised KeyError"), ("short_list", "returned 1 values for 2 completions"),
    ("nan_reward", "returned nan for completion 0"), ("text_reward", "returned '1'"),
])
def test_a_broken_reward_function_is_named(name, says):
    rewards = Rewards([f"tests.rl_user_rewards:{name}"], [1.0])
    with pytest.raises(RewardError, match=f"reward function tests.rl_user_rewards:{name} "
                                          f"{says}"):
        rewards(["p", "q"], ["a", "b"], {})


@pytest.mark.parametrize("kw,key", [
    (dict(method="grpo"), "rl.rewards"),
    (dict(method="grpo", rewards=["nomodule"]), "rl.rewards"),
    (dict(method="grpo", rewards=["zjax.rl:exact_answer"], group_size=1), "rl.group_size"),
    (dict(rewards=["a.b:c"], reward_weights=[1, 2]), "rl.reward_weights"),
    (dict(loss="bnpo"), "rl.loss"),
])
def test_bad_rl_sections_name_their_key(kw, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        RLConfig(**kw)


def test_an_unknown_reward_function_is_named():
    with pytest.raises(ConfigError, match=r"rl\.rewards: tests\.rl_user_rewards:nothing"):
        Rewards(["tests.rl_user_rewards:nothing"], [1.0])


def test_an_rl_run_on_text_is_refused():
    """Setting rl.method must never train next-token prediction in its place: GRPO samples
    its completions from prompts (data.format prompt), and says so before compiling."""
    import zjax

    config = zjax.load_config("configs/tiny.yaml", ["rl.method=grpo", "train.steps=1",
                                                    "rl.rewards=[zjax.rl:exact_answer]"])
    with pytest.raises(ConfigError, match=r"data\.format: text, but rl\.method grpo"):
        zjax.train(None, config)
