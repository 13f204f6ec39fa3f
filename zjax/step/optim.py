"""The optax optimizer built from the ``optimizer`` config section."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from zjax.config import OptimizerConfig
from zjax.offload import global_norm

__all__ = ["ROUTER_BIAS", "clip_by_global_norm", "make_optimizer", "make_schedule",
           "with_router_bias"]

# the leaf name of DeepSeek-V3's selection bias (zjax.models.llama; transformers'
# ``e_score_correction_bias``)
ROUTER_BIAS = "router_bias"


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """``optax.clip_by_global_norm``, computed so that it also runs on the host.

    optax's own cannot run under ``zero.offload_optimizer.update_on: host`` (see
    :func:`zjax.offload.global_norm`). Same formula otherwise.
    """

    def update(updates, state, params=None):
        del params
        norm = global_norm(updates)
        trigger = norm < max_norm
        return jax.tree.map(
            lambda t: jnp.where(trigger, t, (t / norm.astype(t.dtype)) * max_norm), updates
        ), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def make_schedule(cfg: OptimizerConfig, *, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0, then cosine decay to lr/10 at ``total_steps`` (or constant).

    As Hugging Face's ``get_cosine_schedule_with_warmup``: step ``s < warmup_steps`` takes
    ``lr * s / warmup_steps``, so ``warmup_steps: 0`` is no warmup (the first step at ``lr``,
    one step of cosine included) and a warmup as long as the run or longer is cut by its end:
    the rate never reaches ``lr`` (accepted, as Hugging Face and DeepSpeed's ``WarmupDecayLR``
    accept it; the trainer says so). The cosine always spans at least one step, so no length
    of run or warmup leaves optax a decay of 0 steps.
    """
    warmup, decay = cfg.warmup_steps, max(1, total_steps - cfg.warmup_steps)
    if cfg.schedule == "cosine":
        cosine = optax.cosine_decay_schedule(cfg.lr, decay, alpha=0.1)
    else:
        cosine = optax.constant_schedule(cfg.lr)
    if not warmup:  # optax's linear_schedule of 0 steps is a constant 0, not a jump to lr
        return cosine
    return optax.join_schedules([optax.linear_schedule(0.0, cfg.lr, warmup), cosine], [warmup])


def make_optimizer(cfg: OptimizerConfig, *, total_steps: int,
                   clip_in_step: bool = False) -> optax.GradientTransformation:
    """The optimizer on :func:`make_schedule`, with optional global-norm clipping.

    Args:
      cfg: the ``optimizer`` section.
      total_steps: the schedule's length.
      clip_in_step: leave ``cfg.clip_norm`` to the train step (``make_step(clip_norm=)``),
        so that the transform is elementwise, as the NVMe optimizer needs: an identity takes
        the clip's place, so the state (and a checkpoint of it) is the same as with the clip.
    """
    lr = make_schedule(cfg, total_steps=total_steps)
    if cfg.name == "adamw":
        opt = optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay)
    elif cfg.name == "adam":
        opt = optax.adam(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps)
    else:
        opt = optax.sgd(lr)
    if cfg.clip_norm is None:
        return opt
    clip = optax.identity() if clip_in_step else clip_by_global_norm(cfg.clip_norm)
    return optax.chain(clip, opt)


def _leaf_name(path) -> str:
    last = path[-1] if path else None
    return str(getattr(last, "key", getattr(last, "name", last)))


def with_router_bias(tx: optax.GradientTransformation,
                     speed: float) -> optax.GradientTransformation:
    """``tx`` for every leaf but the routers' selection biases (leaves named
    :data:`ROUTER_BIAS`), which DeepSeek-V3's auxiliary-loss-free balancing moves by
    ``-speed x sign(gradient)``: their gradient is the load error
    (:func:`zjax.nn.moe.load_feedback`), so an overloaded expert's bias goes down by
    ``speed``, an idle one's up, a balanced one's stays. No weight decay, no moments, no
    schedule: the update DeepSeek-V3 describes (its ``bias_update_speed``).
    """
    def update(grads, state, params=None):
        del params
        return jax.tree.map(lambda g: -speed * jnp.sign(g).astype(g.dtype), grads), state

    rule = optax.GradientTransformation(lambda params: optax.EmptyState(), update)

    def labels(params):  # of params, or of their specs (zjax maps the state's placement)
        return jax.tree_util.tree_map_with_path(
            lambda path, _: "bias" if _leaf_name(path) == ROUTER_BIAS else "rest", params,
            is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))

    return optax.multi_transform({"rest": tx, "bias": rule}, labels)
