"""The preference losses against direct NumPy implementations of their papers' formulas, on
random log-probabilities: values and gradients (float64 NumPy, central differences; the
JAX losses in float32: relative tolerance 1e-5 on values, 1e-3 on gradients)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zjax.errors import ConfigError
from zjax.preference import Pairs, PreferenceConfig, pair_losses


def _logsig(x):
    return -np.logaddexp(0.0, -x)


def _numpy_loss(method, c, r, nc, nr, rc, rr, *, beta, eps=0.0, gamma=0.5, sft=0.0):
    """Each paper's loss per pair, written out (float64)."""
    if method == "dpo":  # Rafailov et al. 2023; conservative DPO (Mitchell 2023)
        z = beta * ((c - rc) - (r - rr))
        loss = -(1 - eps) * _logsig(z) - eps * _logsig(-z)
    elif method == "ipo":  # Azar et al. 2023, on length-averaged log-likelihoods
        h = (c / nc - rc / nc) - (r / nr - rr / nr)
        loss = (h - 1 / (2 * beta)) ** 2
    elif method == "simpo":  # Meng et al. 2024
        z = beta * (c / nc) - beta * (r / nr) - gamma
        loss = -(1 - eps) * _logsig(z) - eps * _logsig(-z)
    else:  # ORPO, Hong et al. 2024: odds(y|x) = P / (1 - P), P the average likelihood
        pc, pr = np.exp(c / nc), np.exp(r / nr)
        ratio = np.log((pc / (1 - pc)) / (pr / (1 - pr)))
        loss = -beta * _logsig(ratio)
    return loss + sft * (-c / nc)


def _inputs(seed, n=16):
    rng = np.random.default_rng(seed)
    nc, nr = rng.integers(1, 30, n).astype(float), rng.integers(1, 30, n).astype(float)
    c, r = -rng.uniform(0.05, 3, n) * nc, -rng.uniform(0.05, 3, n) * nr
    rc, rr = c + rng.normal(0, 2, n), r + rng.normal(0, 2, n)
    return c, r, nc, nr, rc, rr


def _jax_loss(cfg, c, r, nc, nr, rc, rr):
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    ref = (f32(rc), f32(rr)) if cfg.source != "none" else (None, None)
    return pair_losses(Pairs(f32(c), f32(r), f32(nc), f32(nr), *ref), cfg)


CASES = [
    ("dpo", dict(beta=0.1)),
    ("dpo", dict(beta=0.5, label_smoothing=0.2)),
    ("dpo", dict(beta=0.1, sft_weight=0.7)),
    ("ipo", dict(beta=0.1)),
    ("simpo", dict(beta=2.0, gamma=1.0)),
    ("simpo", dict(beta=2.0, gamma=0.5, label_smoothing=0.1)),
    ("orpo", dict(beta=0.1)),
    ("orpo", dict(beta=0.25, sft_weight=0.5)),
]


@pytest.mark.parametrize("method,kw", CASES)
def test_each_loss_is_its_papers_formula_values_and_gradients(method, kw):
    cfg = PreferenceConfig(method=method, **kw)
    c, r, nc, nr, rc, rr = _inputs(len(kw) + len(method))
    np_kw = dict(beta=cfg.beta, eps=cfg.label_smoothing, gamma=cfg.gamma, sft=cfg.nll_weight)
    want = _numpy_loss(method, c, r, nc, nr, rc, rr, **np_kw)
    got, metrics = _jax_loss(cfg, c, r, nc, nr, rc, rr)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
    # gradients of the summed loss in the policy's log-probs, against central differences
    grad = jax.grad(lambda a, b: jnp.sum(_jax_loss(cfg, a, b, nc, nr, rc, rr)[0]),
                    argnums=(0, 1))(jnp.asarray(c, jnp.float32), jnp.asarray(r, jnp.float32))
    h = 1e-6
    for k, g in enumerate(grad):
        def at(d, k=k):
            return (c + d, r, nc, nr, rc, rr) if k == 0 else (c, r + d, nc, nr, rc, rr)

        numeric = (_numpy_loss(method, *at(h), **np_kw)
                   - _numpy_loss(method, *at(-h), **np_kw)) / (2 * h)
        np.testing.assert_allclose(np.asarray(g), numeric, rtol=1e-3, atol=1e-6)
    assert set(metrics) >= {"rewards/chosen", "rewards/rejected", "rewards/accuracies",
                            "rewards/margins", "logps/chosen", "logps/rejected"}


def test_dpo_metrics_are_trls():
    cfg = PreferenceConfig(method="dpo", beta=0.2)
    c, r, nc, nr, rc, rr = _inputs(3)
    _, m = _jax_loss(cfg, c, r, nc, nr, rc, rr)
    np.testing.assert_allclose(m["rewards/chosen"], 0.2 * (c - rc), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(m["rewards/rejected"], 0.2 * (r - rr), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(
        m["rewards/accuracies"],
        (np.asarray(m["rewards/chosen"]) > np.asarray(m["rewards/rejected"])).astype(float))
    np.testing.assert_allclose(m["rewards/margins"], 0.2 * ((c - rc) - (r - rr)), atol=1e-5)
    np.testing.assert_allclose(m["logps/chosen"], c, rtol=1e-6)


def test_first_losses_with_the_reference_equal_to_the_policy():
    c, r, nc, nr, _, _ = _inputs(5)
    dpo, _ = _jax_loss(PreferenceConfig(method="dpo"), c, r, nc, nr, c, r)
    np.testing.assert_allclose(np.asarray(dpo), math.log(2), rtol=1e-6)
    ipo, _ = _jax_loss(PreferenceConfig(method="ipo", beta=0.1), c, r, nc, nr, c, r)
    np.testing.assert_allclose(np.asarray(ipo), (1 / (2 * 0.1)) ** 2, rtol=1e-6)


@pytest.mark.parametrize("kw,key", [
    (dict(method="dpo", reference="none"), "preference.reference"),
    (dict(method="simpo", reference="model"), "preference.reference"),
    (dict(method="ipo", label_smoothing=0.1), "preference.label_smoothing"),
    (dict(method="dpo", beta=0.0), "preference.beta"),
    (dict(method="kto"), "preference.method"),
])
def test_bad_sections_name_their_key(kw, key):
    with pytest.raises(ConfigError, match=key):
        PreferenceConfig(**kw)


def test_defaults_follow_the_method():
    assert PreferenceConfig(method="dpo").source == "model"
    assert PreferenceConfig(method="orpo").source == "none"
    assert PreferenceConfig(method="orpo").nll_weight == 1.0
    assert PreferenceConfig(method="dpo").nll_weight == 0.0
    assert not PreferenceConfig().enabled


def test_orpo_gradients_stay_finite_for_a_certain_answer():
    """ORPO's ``log(1 - p)`` at an average log-prob float32 rounds to 0 (a certain answer):
    neither branch of its ``where`` may put a NaN into the gradient."""
    cfg = PreferenceConfig(method="orpo")
    c = jnp.asarray([0.0, -1e-9, -3.0, -0.5])
    grad = jax.grad(lambda c: jnp.sum(_jax_loss(cfg, c, c - 1, [1.0] * 4, [1.0] * 4, None,
                                                None)[0]))(c)
    assert np.all(np.isfinite(np.asarray(grad)))
