"""Bad input gets a ConfigError naming the key; the CLI exits 2 without a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest

import zjax
from tests.models import gpt_trainable
from zjax.config import Config, load_config

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["zero.stage=4"], "zero.stage: 4 is not allowed; choose one of 0, 1, 2, 3"),
        (["zero.prefetch_layers=-1"], "zero.prefetch_layers: must be >= 0, got -1"),
        (["zero.gather_dtype=bf16"], "zero.gather_dtype: unknown dtype 'bf16' (did you mean"),
        (["zero.reduce_dtype=int8"], "zero.reduce_dtype: unknown dtype 'int8'"),
        (["zero.stgae=2"], "unknown key 'zero.stgae' (did you mean 'zero.stage'?)"),
        (["data.batch_size=many"], "data.batch_size: expected an integer, got 'many'"),
        (["data.seq_len=512"], "data.seq_len: 512 exceeds model.max_seq_len 256"),
        (["zero.prefetch_layers=1", "zero.prefetch_bucket_size=100"], "set only one"),
        (["model.n_heads=3"], "model.n_heads: 3 does not divide model.d_model 128"),
    ],
)
def test_bad_config_names_the_key(overrides, needle):
    with pytest.raises(zjax.ConfigError) as e:
        load_config(None, overrides)
    assert needle in str(e.value)


def test_batch_not_divisible_by_data_axis():
    zstep = zjax.make_step(gpt_trainable(), optax.sgd(0.1),
                           zero=zjax.ZeroConfig(stage=3, param_persistence_threshold=100),
                           mesh=zjax.make_mesh())
    with pytest.raises(zjax.ConfigError, match=r"data.batch_size: .* 12 is not divisible .* 8"):
        zstep.lower(jax.ShapeDtypeStruct((12, 17), jnp.int32))


def test_mesh_that_does_not_fit_the_devices():
    with pytest.raises(zjax.ConfigError, match="mesh: data=3 x model=1 = 3 does not equal"):
        zjax.make_mesh(zjax.MeshConfig(data=3))


def test_prefetch_depth_resolution():
    z = zjax.ZeroConfig(prefetch_bucket_size=3 * 1000 * 2)  # bf16: 3 layers of 1000 elements
    assert z.prefetch_depth(layer_elements=1000, n_layers=16) == 3
    z = zjax.ZeroConfig(prefetch_layers=4, max_live_parameters=5000)  # (2 + k) layers live
    assert z.prefetch_depth(layer_elements=1000, n_layers=16) == 3
    assert zjax.ZeroConfig(prefetch_layers=9).prefetch_depth(layer_elements=1, n_layers=4) == 3


def test_yaml_base_inheritance_and_overrides(tmp_path):
    (tmp_path / "base.yaml").write_text("zero: {stage: 2}\ntrain: {steps: 7}\n")
    (tmp_path / "exp.yaml").write_text("base: base.yaml\nzero: {gather_dtype: float32}\n")
    cfg = load_config(tmp_path / "exp.yaml", ["optimizer.lr=1e-3"])
    assert (cfg.zero.stage, cfg.zero.gather_dtype, cfg.train.steps) == (2, "float32", 7)
    assert cfg.optimizer.lr == 1e-3
    assert Config.from_dict(cfg.to_dict()) == cfg


def test_shipped_configs_load():
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        load_config(path)


def _cli(*args, timeout=600):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    return subprocess.run([sys.executable, "-m", "zjax", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


def test_cli_bad_input_exits_2_without_traceback(tmp_path):
    r = _cli("train", "zero.stage=9")
    assert r.returncode == 2
    assert "zero.stage: 9 is not allowed" in r.stderr and "Traceback" not in r.stderr
    r = _cli("train", str(tmp_path / "missing.yaml"))
    assert r.returncode == 2 and "missing.yaml" in r.stderr and "Traceback" not in r.stderr
    r = _cli("train", "data.path=" + str(tmp_path / "nothing-here"))
    assert r.returncode == 2 and "data.path" in r.stderr and "Traceback" not in r.stderr


def test_cli_trains_the_default_gpt_and_loss_falls():
    r = _cli("train", "configs/tiny.yaml", "train.steps=40", "train.log_every=10",
             "train.eval_every=40")
    assert r.returncode == 0, r.stderr[-3000:]
    losses = [float(line.split("loss")[1].split("|")[0]) for line in r.stdout.splitlines()
              if line.startswith("step")]
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.5, r.stdout
    assert "ZeRO stage 3 on data=8" in r.stdout and "eval" in r.stdout
