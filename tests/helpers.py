"""Shared test helpers: the one tree-compare, a single-device optax reference, and the two ways
to run the ``zjax`` CLI: in this process (:func:`zjax_main`, the default: no interpreter start,
no jax import, no device start-up, compiles shared with the test) and in a subprocess
(:func:`run_zjax`, :func:`start_zjax`: only where the process boundary is what a test tests).

Tolerances (documented once, used everywhere):
- ``FP32``: sharded fp32 runs vs the single-device reference. Reductions happen in another
  order (per-shard partial sums, reduce-scatter, sum-then-divide instead of mean), so results
  differ by rounding only. rtol 2e-5, atol 1e-5: Adam's update ``mu / (sqrt(nu) + eps)``
  amplifies the rounding of near-zero gradients (the tests use eps 1e-5 so a gradient of 1e-9
  cannot flip a whole step), and 1e-5 is 1/300 of one step at the tests' lr 3e-3.
  A wrong reduction (a missing psum, a double count) is off by whole steps, far outside.
- ``GRADS``: raw fp32 gradients of O(10) magnitude summed over 8 shards in another order:
  rtol 1e-4, atol 1e-5 (a factor-of-8 or missing-shard error is off by O(1)).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

ROOT = Path(__file__).resolve().parent.parent
FP32 = {"rtol": 2e-5, "atol": 1e-5}
GRADS = {"rtol": 1e-4, "atol": 1e-5}


def assert_trees_close(actual, expected, *, rtol: float, atol: float, what: str = "tree",
                       scaled: bool = False):
    """Assert two pytrees have equal structure and allclose leaves; names the worst leaf.

    ``scaled``: ``atol`` is relative to each leaf's largest ``expected`` entry. For sums
    taken in another order (over devices, chunks or an exchange): float32's error bound is
    eps x the sum of the terms' magnitudes, not the result's, so an entry whose terms cancel
    keeps the absolute error of its leaf's scale, and the order XLA:CPU sums in varies with
    the machine's vector width (1e-5 absolute held on one x86 machine, not on the next).
    """
    a_flat, a_def = jax.tree_util.tree_flatten_with_path(actual)
    e_flat, e_def = jax.tree_util.tree_flatten_with_path(expected)
    assert a_def == e_def, f"{what}: structures differ\n{a_def}\n{e_def}"
    for (path, a), (_, e) in zip(a_flat, e_flat, strict=True):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        assert a.shape == e.shape, f"{what}{jax.tree_util.keystr(path)}: {a.shape} != {e.shape}"
        tol = atol * float(np.abs(e).max(initial=0.0)) if scaled else atol
        np.testing.assert_allclose(
            a, e, rtol=rtol, atol=tol, err_msg=f"{what}{jax.tree_util.keystr(path)}"
        )


def assert_replicas_identical(tree, *, what: str = "tree") -> None:
    """Every copy of a replicated slice is bitwise the same on every device that holds it.

    XLA assumes it (it reads whichever replica it likes, Orbax saves one of them); a gradient
    missing its sum over an axis leaves the copies apart, which no loss shows at first."""
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        copies: dict[str, np.ndarray] = {}
        for shard in x.addressable_shards:
            first = copies.setdefault(str(shard.index), np.asarray(shard.data))
            np.testing.assert_array_equal(
                np.asarray(shard.data), first,
                err_msg=f"{what}{jax.tree_util.keystr(path)}: replicas of {shard.index} differ")


def make_tx() -> optax.GradientTransformation:
    """The optimizer of the equality tests: AdamW (eps 1e-5, see ``FP32``) after clipping."""
    adamw = optax.adamw(3e-3, eps=1e-5, weight_decay=0.1)
    return optax.chain(optax.clip_by_global_norm(0.5), adamw)


def reference_run(init, loss_fn, tx, batches, *, seed: int = 0):
    """Plain single-device optax: ``loss_fn(params, batch) -> (sum, count)``, mean loss."""
    params = init(jax.random.key(seed))
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        def mean_loss(p):
            s, c = loss_fn(p, batch)
            return s / c

        loss, grads = jax.value_and_grad(mean_loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    with jax.default_device(jax.devices()[0]):
        for batch in batches:
            params, opt_state, loss = step(params, opt_state, jax.tree.map(jnp.asarray, batch))
            losses.append(float(loss))
    return params, opt_state, losses


def adam_moments(opt_state):
    """(mu, nu) of the Adam state inside an optax chain."""
    for s in jax.tree.leaves(opt_state, is_leaf=lambda x: hasattr(x, "mu")):
        if hasattr(s, "mu"):
            return s.mu, s.nu
    raise AssertionError("no Adam state found")


def flat_paths(tree) -> dict:
    """``{"a/b/c": leaf}`` of a params pytree (zjax's leaf paths)."""
    from zjax.partition.plan import path_str

    return {path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def nested_paths(flat: dict) -> dict:
    """The pytree of nested dicts whose :func:`flat_paths` is ``flat``."""
    out: dict = {}
    for path, v in flat.items():
        *head, last = path.split("/")
        node = out
        for k in head:
            node = node.setdefault(k, {})
        node[last] = v
    return out


def train_steps(trainable, zero, batches, *, mesh=None, micro_batches=1):
    """``(zstep, state, losses)`` of ``make_tx()`` steps of ``trainable`` over ``batches``."""
    import zjax

    zstep = zjax.make_step(trainable, make_tx(), zero=zero, mesh=mesh or zjax.make_mesh(),
                           micro_batches=micro_batches)
    state = zstep.init(jax.random.key(0))
    losses = []
    for b in batches:
        state, metrics = zstep.step(state, zstep.put_batch(b))
        losses.append(float(metrics["loss"]))
    return zstep, state, losses


def assert_matches_reference(losses, state, reference) -> None:
    """A sharded run's losses, params and Adam moments against ``reference_run``'s (FP32)."""
    ref_params, ref_opt, ref_losses = reference
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(state.params, ref_params, **FP32, what="params")
    mu, nu = adam_moments(state.opt_state)
    ref_mu, ref_nu = adam_moments(ref_opt)
    assert_trees_close(mu, ref_mu, **FP32, what="mu")
    # nu is ~g^2 (1e-8 and below): its absolute tolerance scales down with it
    assert_trees_close(nu, ref_nu, rtol=FP32["rtol"], atol=1e-9, what="nu")


def children(pid: int) -> list[int]:
    """Child process ids of ``pid`` (from /proc: no pgrep needed)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:  # the field after the state is the parent's id
            out.append(int(stat.parent.name))
    return out


def latest_checkpoint(run_dir: Path, overrides=(), *, step: int | None = None,
                      devices=None, config: str = "configs/tiny.yaml") -> tuple[int, dict]:
    """``(step, canonical state as numpy)`` of the newest checkpoint (or the one at ``step``)
    of a ``config`` run trained with ``overrides``, restored into the step those overrides
    build on ``devices`` (default: this process's)."""
    from zjax import build_step
    from zjax.checkpoint import CheckpointConfig, Checkpointer, to_canonical
    from zjax.config import load_config

    zstep = build_step(load_config(ROOT / config, overrides), devices)
    ckpt = Checkpointer(Path(run_dir) / "checkpoints", CheckpointConfig())
    try:
        if step is None:
            step, state, _, _ = ckpt.restore_latest(zstep)
        else:
            state = ckpt.restore(step, zstep)[0]
    finally:
        ckpt.close()
    return step, jax.tree.map(np.asarray, to_canonical(state, zstep))


def cli_env(**changes: str | None) -> dict[str, str]:
    """The environment of a fresh shell for a zjax subprocess, plus ``changes``.

    No simulated device count in ``XLA_FLAGS`` and no ``JAX_PLATFORMS`` (the CLI simulates
    its own devices, as for a user) and no ``ZJAX_*`` (``zjax launch``'s variables); the rest
    of what conftest set for every process stays: XLA:CPU's optimisation level and fusion
    emitters (a child compiles the programs the tests compile, bit for bit), the cache
    settings (JAX's executable cache on, its folder, the targets' figures beside it) and
    ``ALLOW_MULTIPLE_LIBTPU_LOAD``. A change of None removes the key.
    """
    import re

    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_FLAGS", "JAX_PLATFORMS") and not k.startswith("ZJAX_")}
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                   os.environ.get("XLA_FLAGS", "")).strip()
    if flags:
        env["XLA_FLAGS"] = flags
    for key, value in changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def zjax_main(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """Run ``zjax ARGS`` in this process, as :func:`run_zjax` would in a subprocess.

    ``zjax.cli.main`` with stdout and stderr captured (its log lines, printed results and
    ``zjax: error:`` lines), ``SystemExit`` (argparse's exit 2) taken as the exit code, the
    working directory and the zjax logger restored after. The devices are this process's (8
    simulated, from conftest). What only a subprocess shows, it cannot: interpreter start-up
    noise, signals, exit codes the interpreter sets, C-level writes to file descriptors 1 and 2.
    """
    import contextlib
    import io
    import logging

    from zjax import cli

    logger = logging.getLogger("zjax")
    saved = logger.handlers[:], logger.propagate, logger.level
    out, err = io.StringIO(), io.StringIO()
    previous = os.getcwd()
    try:
        os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli.main([str(a) for a in args])
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
                if isinstance(e.code, str):
                    print(e.code, file=sys.stderr)
    finally:
        os.chdir(previous)
        logger.handlers[:], logger.propagate = saved[0], saved[1]
        logger.setLevel(saved[2])
    return subprocess.CompletedProcess(["zjax", *map(str, args)], code, out.getvalue(),
                                       err.getvalue())


def zjax_cmd(*args: str) -> list[str]:
    """``python -m zjax ARGS`` with this interpreter."""
    return [sys.executable, "-m", "zjax", *args]


def run_zjax(*args: str, cwd: Path = ROOT, env: dict | None = None,
             timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``zjax ARGS`` to its end (from the repository root, in :func:`cli_env`)."""
    return subprocess.run(zjax_cmd(*args), cwd=cwd, env=cli_env() if env is None else env,
                          capture_output=True, text=True, timeout=timeout)


def start_zjax(*args: str, cwd: Path = ROOT, env: dict | None = None,
               **popen: object) -> subprocess.Popen:
    """Start ``zjax ARGS`` (stdout and stderr piped unless ``popen`` says otherwise)."""
    popen = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **popen}
    return subprocess.Popen(zjax_cmd(*args), cwd=cwd, env=cli_env() if env is None else env,
                            text=True, **popen)


def nvme_overrides(path: Path, sub: int = 1000) -> list[str]:
    """Config overrides that put the optimizer on NVMe under ``path`` (small sub-groups and
    two buffers, so that even the tiny model streams many sub-groups)."""
    return ["zero.offload_optimizer.device=nvme", f"zero.offload_optimizer.nvme_path={path}",
            "zero.offload_optimizer.buffer_count=2", f"zero.sub_group_size={sub}"]


# the tiny GPT compiled for a target: 2 layers so each compile takes seconds; every leaf sharded
TARGET_BASE = ("model.n_layers=2", "data.seq_len=64", "zero.param_persistence_threshold=0")


def compile_on(lowered, devices=None):
    """``lowered`` compiled to read its figures (memory, scheduled HLO), as ``zjax plan``
    does (:func:`zjax.runtime.compile_for_figures`): on this process's CPU devices
    (``devices`` None or CPU) without LLVM optimisation, for a target's compile-only
    ``devices`` (in the mesh's order) kept beside JAX's cache, so that a warm run reads them
    instead of compiling again (jax cannot reload a target's executable). Never run it."""
    from zjax.runtime import compile_for_figures

    devices = jax.devices() if devices is None else list(devices)
    return compile_for_figures(lowered, devices, compile_only=devices[0].platform != "cpu")


@functools.cache
def compiled_for(name: str, *overrides: str, file: str = "configs/tiny.yaml"):
    """(zstep, compiled, report) of the tiny GPT's (or ``file``'s) step compiled for target
    ``name`` (``cpu``: the simulated devices), with ``TARGET_BASE`` and ``overrides``."""
    import zjax
    from zjax.planning import report
    from zjax.runtime.targets import target

    config = zjax.load_config(file, [*TARGET_BASE, *overrides])
    zstep = zjax.build_step(config, None if name == "cpu" else target(name))
    compiled = compile_on(zstep.lower(zjax.abstract_batch(config)),
                          None if name == "cpu" else target(name).devices)
    from zjax.task import flops_shape

    return zstep, compiled, report(zstep, compiled,
                                  target=None if name == "cpu" else target(name),
                                  **flops_shape(config))


def sharded_params(zstep, *, layer: bool = False) -> int:
    """Ψ over the sharded leaves, per model slice (what one device gathers over ``data``);
    with ``layer``, of one layer of the stack."""
    plan = zstep.plan
    return sum(leaf.size // (plan.n_model if leaf.model_dim is not None else 1)
               // (leaf.shape[0] if layer else 1)
               for leaf in plan.leaves if leaf.dim is not None and (leaf.stacked or not layer))


def config_losses(file: str, overrides: list[str], *, steps: int, batch_shape=(8, 65),
                  vocab: int = 256) -> list[float]:
    """The losses of ``steps`` steps of ``file``'s step (with ``overrides``) from seed 0, on
    one fixed batch of random tokens ``batch_shape`` below ``vocab``."""
    import zjax

    zstep = zjax.build_step(zjax.load_config(file, overrides))
    state = zstep.init(jax.random.key(0))
    batch = np.random.default_rng(0).integers(0, vocab, batch_shape).astype(np.int32)
    out = []
    for _ in range(steps):
        state, metrics = zstep.step(state, zstep.put_batch(batch))
        out.append(float(metrics["loss"]))
    return out
