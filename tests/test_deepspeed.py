"""DeepSpeed configs read as zjax configs: every key mapped, ignored with a reason, or refused."""

from __future__ import annotations

import json

import pytest
from helpers import ROOT, run_zjax

import zjax
from zjax.config import load_config
from zjax.config._deepspeed import from_deepspeed, read_deepspeed

# the sample of ../shared/reference/ (the DeepSpeed ZeRO-3 article), comments and all
ARTICLE = """{
  "zero_optimization": {
    "stage": 3,
    "contiguous_gradients": true,           // 梯度内存连续化，减少碎片
    "stage3_max_live_parameters": 1e9,      // 最大活跃参数数量
    "stage3_max_reuse_distance": 1e9,       // 参数最大重用距离
    "stage3_prefetch_bucket_size": 1e7,     // 预取桶大小
    "stage3_param_persistence_threshold": 1e5, // 小参数持久化阈值
    "offload_param": {
      "device": "cpu"                       // 参数卸载到CPU
    },
    "offload_optimizer": {
      "device": "cpu"                       // 优化器状态卸载到CPU
    }
  }
}
"""


def _config(ds: dict, *overrides: str, n_data: int = 8):
    imported = from_deepspeed(ds, n_data=n_data)
    return load_config(ROOT / "configs/tiny.yaml", [*imported.overrides, *overrides]), imported


def test_the_articles_sample_maps_every_key(tmp_path):
    (tmp_path / "ds.json").write_text(ARTICLE)
    config, imported = _config(read_deepspeed(tmp_path / "ds.json"))
    z = config.zero
    assert (z.stage, z.param_persistence_threshold, z.max_live_parameters) == (3, 10**5, 10**9)
    # DeepSpeed's bucket counts elements; zjax's bytes (float32 without bf16/fp16)
    assert z.prefetch_bucket_size == 4 * 10**7 and z.prefetch_layers is None
    assert z.offload_param.device == "host" and z.offload_optimizer.device == "host"
    assert z.gather_dtype == "float32"
    ignored = dict(imported.ignored)
    assert set(ignored) == {"zero_optimization.contiguous_gradients",
                            "zero_optimization.stage3_max_reuse_distance"}
    assert all(ignored.values())  # each with its reason


def test_batch_sizes_are_per_gpu_in_deepspeed_and_global_in_zjax():
    config, _ = _config({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4})
    assert (config.data.batch_size, config.train.grad_accum) == (64, 4)
    config, _ = _config({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2},
                        n_data=4)
    assert (config.data.batch_size, config.train.grad_accum) == (32, 4)
    with pytest.raises(zjax.ConfigError, match=r"^deepspeed train_batch_size: 30 != .* 2 x "
                                               r"gradient_accumulation_steps 2 x 8 data"):
        from_deepspeed({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 2,
                        "gradient_accumulation_steps": 2}, n_data=8)


def test_mics_shard_size_is_hybrid_sharding_and_zeropp_maps():
    config, ignored = _config({"zero_optimization": {"stage": 3, "mics_shard_size": 2,
                                                     "mics_hierarchical_params_gather": True}})
    assert (config.mesh.replica, config.mesh.data) == (4, 2)
    config, _ = _config({"zero_optimization": {"zero_quantized_weights": True,
                                               "zero_quantized_gradients": True}})
    assert config.zero.quantized_weights and config.zero.quantized_gradients
    assert any("mics_hierarchical_params_gather" in key for key, _ in ignored.ignored)
    config, _ = _config({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 4}})
    assert config.zero.hpz_partition_size == 4


def test_optimizer_scheduler_precision_and_hf_auto_values():
    ds = {"bf16": {"enabled": True}, "communication_data_type": "bf16",
          "optimizer": {"type": "Adam", "params": {"lr": "auto", "betas": [0.9, 0.98],
                                                   "eps": 1e-6, "weight_decay": 0.01}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0,
                                                       "warmup_max_lr": 1e-3,
                                                       "warmup_num_steps": 50}},
          "gradient_clipping": 0.5, "steps_per_print": 5,
          "train_micro_batch_size_per_gpu": "auto"}
    config, imported = _config(ds)
    o = config.optimizer
    # DeepSpeed's Adam is AdamW unless adam_w_mode is false
    assert (o.name, o.lr, o.b2, o.eps, o.weight_decay) == ("adamw", 1e-3, 0.98, 1e-6, 0.01)
    assert (o.schedule, o.warmup_steps, o.clip_norm) == ("constant", 50, 0.5)
    assert (config.zero.gather_dtype, config.zero.reduce_dtype) == ("bfloat16", "bfloat16")
    assert config.train.log_every == 5 and config.data.batch_size == 16  # "auto": tiny's
    assert "train_micro_batch_size_per_gpu" in dict(imported.ignored)
    config, _ = _config({"bf16": {"enabled": "auto"}})  # HF decides: tiny.yaml's bf16 kept
    assert config.zero.gather_dtype == "bfloat16"
    config, _ = _config({"zero_optimization": {"stage": 2}})  # no bf16/fp16: fp32 training
    assert config.zero.gather_dtype == "float32"


@pytest.mark.parametrize(("ds", "match"), [
    ({"zero_optimization": {"stage3_prefetch_bucket": 1}},
     r"^deepspeed zero_optimization.stage3_prefetch_bucket: unknown key \(did you mean "
     r"'stage3_prefetch_bucket_size'\?\)"),
    ({"optimizer": {"type": "Lamb"}}, r"^deepspeed optimizer.type: 'Lamb' is not mapped"),
    ({"scheduler": {"type": "OneCycle"}}, r"^deepspeed scheduler.type: 'OneCycle'"),
    ({"zero_optimization": {"zero_hpz_partition_size": 3}},
     r"zero_hpz_partition_size: 3 does not divide the 8 data ranks"),
    ({"zero_optimization": {"mics_shard_size": 3}}, r"mics_shard_size: 3 does not divide the "
                                                    r"8 data ranks"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, r"both true"),
    ({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False, "weight_decay": 0.1}}},
     r"L2-regularised Adam"),
])
def test_what_zjax_cannot_do_is_refused_naming_the_key(ds, match):
    with pytest.raises(zjax.ConfigError, match=match):
        from_deepspeed(ds, n_data=8)


def test_nvme_offload_maps_its_keys_and_needs_a_path():
    """ZeRO-Infinity's optimizer keys land in zjax's; without nvme_path zjax's own error."""
    cfg, _ = _config({"zero_optimization": {
        "stage": 3, "sub_group_size": 1_000_000,
        "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme",
                              "buffer_count": 5, "pipeline_read": True}}})
    section = cfg.zero.offload_optimizer
    assert (section.device, section.nvme_path, section.buffer_count) == ("nvme", "/local_nvme", 5)
    assert cfg.zero.sub_group_size == 1_000_000
    with pytest.raises(zjax.ConfigError, match=r"zero.offload_optimizer.nvme_path: required"):
        _config({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}})


def test_cli_converts_and_refuses_with_exit_2(tmp_path):
    (tmp_path / "ds.json").write_text(ARTICLE)
    out = tmp_path / "zjax.yaml"
    r = run_zjax("config", "from-deepspeed", str(tmp_path / "ds.json"), "configs/tiny.yaml",
                 "-o", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "stage3_max_reuse_distance: ignored: " in r.stderr and r.stdout == ""
    assert load_config(out).zero.prefetch_bucket_size == 4 * 10**7
    r = run_zjax("config", "from-deepspeed", str(tmp_path / "ds.json"))  # YAML on stdout
    assert load_config(None, []).to_dict().keys() == __import__("yaml").safe_load(
        r.stdout).keys()
    (tmp_path / "bad.json").write_text(json.dumps({"zero_optimization": {"stage": 3,
                                                                         "overlap_com": True}}))
    r = run_zjax("config", "from-deepspeed", str(tmp_path / "bad.json"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "deepspeed zero_optimization.overlap_com: unknown key (did you mean " \
           "'overlap_comm'?)" in r.stderr


@pytest.mark.slow
def test_train_with_the_articles_sample(tmp_path):
    """`zjax train --deepspeed`: ZeRO-3 with both offloads, as the article configures it."""
    (tmp_path / "ds.json").write_text(ARTICLE)
    # the article's persistence threshold (1e5) keeps every leaf of the tiny GPT whole
    r = run_zjax("train", "--deepspeed", str(tmp_path / "ds.json"), "configs/tiny.yaml",
                 "zero.param_persistence_threshold=4096", "train.steps=10",
                 "train.log_every=5", "train.eval_every=0", "--run-dir", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr[-3000:]
    saved = load_config(tmp_path / "run" / "config.yaml")
    assert saved.zero.offload_param.device == "host"
    assert saved.zero.prefetch_bucket_size == 4 * 10**7
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
            .splitlines()]
    assert [row["step"] for row in rows] == [5, 10] and rows[-1]["state_host_bytes"] > 0
    assert "deepspeed zero_optimization.contiguous_gradients: ignored" in r.stdout
