"""Bad input gets a ConfigError naming the key; the CLI exits 2 without a traceback."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import ROOT, zjax_main
from models import gpt_trainable

import zjax
from zjax.config import Config, load_config


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
        (["zero.offload_optimizer.device=nvme"],
         "zero.offload_optimizer.nvme_path: required with device: nvme"),
        (["zero.offload_param.device=nvme"],
         "zero.offload_param.device: nvme needs zero.offload_optimizer"),
        (["zero.offload_param.device=gpu"], "zero.offload_param.device: 'gpu' is not allowed"),
        (["zero.stage=0", "zero.offload_optimizer.device=host"],
         "zero.offload_optimizer.device: host needs a sharded state (stage 1, 2 or 3)"),
        (["zero.offload_optimizer.update_on=host"],
         "zero.offload_optimizer.update_on: 'host' needs zero.offload_optimizer.device: host"),
        (["zero.offload_optimizer.devcie=host"],
         "unknown key 'zero.offload_optimizer.devcie' (did you mean"),
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
    # the engine names its own argument; the config layer names the key it came from
    with pytest.raises(zjax.ArgumentError,
                       match=r"^batch: the global batch of 12 is not divisible by the data axis"):
        zstep.lower(jax.ShapeDtypeStruct((12, 17), jnp.int32))
    built = zjax.build_step(load_config(ROOT / "configs/tiny.yaml", ["data.batch_size=12"]))
    with pytest.raises(zjax.ConfigError, match=r"^data.batch_size: .* 12 is not divisible .* 8"):
        zjax.plan(load_config(ROOT / "configs/tiny.yaml", ["data.batch_size=12"]))
    with pytest.raises(zjax.ArgumentError, match=r"^batch: "):
        built.check_batch((12, 17))


def test_mesh_that_does_not_fit_the_devices():
    with pytest.raises(zjax.ConfigError, match="mesh: data=3 x model=1 = 3 does not equal"):
        zjax.make_mesh(zjax.MeshConfig(data=3))


def test_prefetch_depth_resolution():
    z = zjax.ZeroConfig(prefetch_bucket_size=3 * 1000 * 2)  # bf16: 3 layers of 1000 elements
    assert z.prefetch_depth(layer_elements=1000, n_layers=16) == 3
    z = zjax.ZeroConfig(prefetch_layers=4, max_live_parameters=5000)  # (2 + k) layers live
    assert z.prefetch_depth(layer_elements=1000, n_layers=16) == 3
    assert zjax.ZeroConfig(prefetch_layers=9).prefetch_depth(layer_elements=1, n_layers=5) == 2


def test_yaml_base_inheritance_and_overrides(tmp_path):
    (tmp_path / "base.yaml").write_text("zero: {stage: 2}\ntrain: {steps: 7}\n")
    (tmp_path / "exp.yaml").write_text("base: base.yaml\nzero: {gather_dtype: float32}\n")
    cfg = load_config(tmp_path / "exp.yaml", ["optimizer.lr=1e-3"])
    assert (cfg.zero.stage, cfg.zero.gather_dtype, cfg.train.steps) == (2, "float32", 7)
    assert cfg.optimizer.lr == 1e-3
    assert Config.from_dict(cfg.to_dict()) == cfg


def test_shipped_configs_load():
    paths = sorted((ROOT / "configs").glob("*.yaml")) + sorted((ROOT / "configs").glob("*.gin"))
    assert len(paths) >= 10
    for path in paths:
        load_config(path)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-stage0.yaml", "tiny-stage1.yaml", "tiny-offload.yaml",
                                  "tiny-stage3-prefetch2.yaml"])
def test_small_configs_train_a_few_steps(name):
    cfg = load_config(ROOT / "configs" / name, ["train.steps=3", "train.log_every=3",
                                                "train.eval_every=0"])
    history = zjax.train(None, cfg).history
    assert len(history) == 1 and np.isfinite(history[0]["loss"])


def _cli(*args):
    return zjax_main(*args)


def test_cli_bad_input_exits_2_without_traceback(tmp_path):
    r = _cli("train", "zero.stage=9")
    assert r.returncode == 2
    assert "zero.stage: 9 is not allowed" in r.stderr and "Traceback" not in r.stderr
    r = _cli("train", str(tmp_path / "missing.yaml"))
    assert r.returncode == 2 and "missing.yaml" in r.stderr and "Traceback" not in r.stderr
    r = _cli("train", "data.path=" + str(tmp_path / "nothing-here"))
    assert r.returncode == 2 and "data.path" in r.stderr and "Traceback" not in r.stderr
    r = _cli("train", "configs/tiny.yaml", "data.batch_size=12")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "data.batch_size: the global batch of 12 is not divisible" in r.stderr


@pytest.mark.slow
@pytest.mark.long_training
def test_cli_trains_the_default_gpt_and_loss_falls():
    r = _cli("train", "configs/tiny.yaml", "train.steps=40", "train.log_every=10",
             "train.eval_every=40")
    assert r.returncode == 0, r.stderr[-3000:]
    losses = [float(line.split("loss")[1].split("|")[0]) for line in r.stdout.splitlines()
              if line.startswith("step")]
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.5, r.stdout
    assert "on 8 devices, ZeRO stage 3" in r.stdout and "eval" in r.stdout


def test_yaml_and_gin_resolve_to_the_same_config():
    assert load_config(ROOT / "configs/tiny.gin") == load_config(ROOT / "configs/tiny.yaml")
    assert (load_config(ROOT / "configs/tiny.gin", ["zero.stage=1"])
            == load_config(ROOT / "configs/tiny.yaml", ["zero.stage=1"]))


@pytest.mark.parametrize(("text", "needle"), [
    ("zro.stage = 2\n", "No configurable matching 'zro'. (did you mean 'zero'?)"),
    ("zero.stgae = 2\n", "unknown key 'zero.stgae' (did you mean 'zero.stage'?)"),
    ("zero.stage = 7\n", "zero.stage: 7 is not allowed"),
])
def test_gin_errors_name_the_binding(tmp_path, text, needle):
    (tmp_path / "x.gin").write_text(text)
    with pytest.raises(zjax.ConfigError) as e:
        load_config(tmp_path / "x.gin")
    assert needle in str(e.value)


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    (tmp_path / "bad.yaml").write_text("zero:\n  stage: [1\n")
    needle = r"bad.yaml.* is not valid YAML at line 3, column 1: expected"
    with pytest.raises(zjax.ConfigError, match=needle):
        load_config(tmp_path / "bad.yaml")


def test_readme_config_reference_is_in_sync():
    from zjax.cli._docs import config_reference

    assert config_reference() in (ROOT / "README.md").read_text(), (
        "README's config reference is stale: run `python -m zjax.cli.docs --write README.md`"
    )


def test_cli_config_show_and_gin_error_exit_code(tmp_path):
    r = _cli("config", "show", "configs/tiny.gin", "zero.stage=2")
    assert r.returncode == 0 and "stage: 2" in r.stdout
    (tmp_path / "x.gin").write_text("nothing.here = 1\n")
    r = _cli("train", str(tmp_path / "x.gin"))
    assert r.returncode == 2 and "nothing" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_cli_run_dir_and_plot(tmp_path):
    run = tmp_path / "run"
    r = _cli("train", "configs/tiny-stage2.yaml", "train.steps=4", "train.log_every=2",
             "train.eval_every=0", "--run-dir", str(run))
    assert r.returncode == 0, r.stderr[-2000:]
    assert (run / "metrics.jsonl").read_text().count("\n") == 2
    r = _cli("plot", str(run))
    assert r.returncode == 0 and (run / "loss.png").stat().st_size > 0
    r = _cli("plot", str(tmp_path / "nope"))
    assert r.returncode == 2 and "metrics.jsonl" in r.stderr
