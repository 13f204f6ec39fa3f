"""DeepSpeed configs read as zjax configs: every key mapped, ignored with a reason, or refused."""

from __future__ import annotations

import json
import re

import pytest
from helpers import ROOT, zjax_main

import zjax
from zjax.config import load_config
from zjax.config._deepspeed import from_deepspeed, read_deepspeed
from zjax.errors import ConfigError

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


def test_sequence_parallel_size_is_the_context_axis():
    # DeepSpeed-Ulysses' data ranks are the devices over the sequence-parallel group
    config, imported = _config({"sequence_parallel_size": 4, "train_micro_batch_size_per_gpu": 2,
                                "seq_parallel_communication_data_type": "fp32"})
    assert (config.mesh.context, config.data.batch_size) == (4, 4)
    assert "seq_parallel_communication_data_type" in dict(imported.ignored)
    with pytest.raises(zjax.ConfigError, match=r"^deepspeed sequence_parallel_size: 3 does not "
                                               r"divide the 8 devices"):
        from_deepspeed({"sequence_parallel_size": 3}, n_data=8)


def test_deepspeed_moe_section_is_the_expert_axis_and_the_experts():
    """DeepSpeed-MoE's ``moe`` section: ``ep_size`` is ``mesh.expert`` (out of the data ranks,
    which stay the batch's), ``num_experts`` (a count or one per layer) ``model.n_experts``."""
    ds = {"moe": {"enabled": True, "ep_size": 2, "num_experts": [4, 4], "type": "standard",
                  "ep_group": None}, "train_micro_batch_size_per_gpu": 1}
    imported = from_deepspeed(ds, n_data=8)
    config = load_config(ROOT / "configs/llama-tiny.yaml", [*imported.overrides, "data.path="])
    assert (config.mesh.expert, config.model.n_experts, config.data.batch_size) == (2, 4, 8)
    assert "moe.ep_group" in dict(imported.ignored)
    assert ("moe", "not enabled") in from_deepspeed({"moe": False}, n_data=8).ignored
    with pytest.raises(zjax.ConfigError, match=r"^deepspeed moe\.ep_size: 3 does not divide "
                                               r"the 4 data ranks"):
        from_deepspeed({"moe": {"ep_size": 3}, "sequence_parallel_size": 2}, n_data=8)
    for section, match in [({"num_experts": [8, 16]}, r"moe\.num_experts: \[8, 16\]: the "
                                                       r"experts differ by layer"),
                           ({"type": "residual"}, r"moe\.type: 'residual' \(PR-MoE"),
                           ({"ep_sise": 2}, r"moe\.ep_sise: unknown key \(did you mean "
                                            r"'ep_size'\?\)")]:
        with pytest.raises(zjax.ConfigError, match=match):
            from_deepspeed({"moe": section}, n_data=8)


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
    r = zjax_main("config", "from-deepspeed", str(tmp_path / "ds.json"), "configs/tiny.yaml",
                  "-o", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "stage3_max_reuse_distance: ignored: " in r.stderr and r.stdout == ""
    assert load_config(out).zero.prefetch_bucket_size == 4 * 10**7
    r = zjax_main("config", "from-deepspeed", str(tmp_path / "ds.json"))  # YAML on stdout
    assert load_config(None, []).to_dict().keys() == __import__("yaml").safe_load(
        r.stdout).keys()
    (tmp_path / "bad.json").write_text(json.dumps({"zero_optimization": {"stage": 3,
                                                                         "overlap_com": True}}))
    r = zjax_main("config", "from-deepspeed", str(tmp_path / "bad.json"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "deepspeed zero_optimization.overlap_com: unknown key (did you mean " \
           "'overlap_comm'?)" in r.stderr


# DeepSpeed reads ds_config.json with hjson: comments of three kinds and trailing commas
HJSON = """{
  // the optimizer
  "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95,],},},
  # ZeRO
  "zero_optimization": {
    /* stage 3, with
       the optimizer on the host */
    "stage": 3,
    "offload_optimizer": {"device": "cpu",},  // trailing commas too
  },
  "train_micro_batch_size_per_gpu": 2,
}
"""
PLAIN = {"optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95]}},
         "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
         "train_micro_batch_size_per_gpu": 2}


def test_hjson_comments_and_trailing_commas_read_as_the_plain_json(tmp_path):
    (tmp_path / "ds.json").write_text(HJSON)
    (tmp_path / "plain.json").write_text(json.dumps(PLAIN))
    assert read_deepspeed(tmp_path / "ds.json") == PLAIN == read_deepspeed(tmp_path / "plain.json")
    assert from_deepspeed(read_deepspeed(tmp_path / "ds.json"), n_data=8) == from_deepspeed(
        PLAIN, n_data=8)


@pytest.mark.parametrize(("text", "key"), [
    ('{"steps_per_print": 5,\n "gradient_clipping": 1.0,\n "steps_per_print": 50}',
     "steps_per_print"),
    ('{"zero_optimization": {"stage": 2, "overlap_comm": true, "stage": 3}}',
     "zero_optimization.stage"),
    ('{"zero_optimization": {"offload_optimizer": {"device": "cpu", "device": "nvme"}}}',
     "zero_optimization.offload_optimizer.device"),
    ('{"optimizer": {"params": {"betas": [{"x": 1, "x": 2}]}}}', "optimizer.params.betas[0].x"),
])
def test_duplicated_keys_are_refused_naming_the_key_path(tmp_path, text, key):
    """DeepSpeed refuses them (dict_raise_error_on_duplicate_keys): no "last one wins"."""
    (tmp_path / "ds.json").write_text(text)
    with pytest.raises(zjax.ConfigError, match=rf"^--deepspeed: '.*ds.json': key {re.escape(key)}"
                                               r" appears more than once"):
        read_deepspeed(tmp_path / "ds.json")


@pytest.mark.parametrize(("text", "match"), [
    ('{"gradient_clipping": NaN,\n "steps_per_print": 5}',  # hjson: the string 'NaN,'
     r"^deepspeed gradient_clipping: expected a finite number, got NaN$"),
    ('{"optimizer": {"type": "Adam", "params": {"lr": Infinity\n}}}',
     r"^deepspeed optimizer.params.lr: expected a finite number, got Infinity$"),
    ('{"gradient_clipping": NaN // no clipping\n}',
     r"^deepspeed gradient_clipping: expected a finite number, got NaN$"),
    ('{"train_micro_batch_size_per_gpu": -Infinity\n}',
     r"^deepspeed train_micro_batch_size_per_gpu: expected a finite number, got -Infinity$"),
])
def test_nan_and_infinity_in_the_file_are_refused_naming_the_key(tmp_path, text, match):
    (tmp_path / "ds.json").write_text(text)
    with pytest.raises(zjax.ConfigError, match=match):
        from_deepspeed(read_deepspeed(tmp_path / "ds.json"), n_data=8)


@pytest.mark.parametrize(("ds", "match"), [  # Python's json reads NaN and Infinity as floats
    ({"gradient_clipping": float("nan")}, r"^deepspeed gradient_clipping: .* got nan$"),
    ({"train_batch_size": float("inf")}, r"^deepspeed train_batch_size: .* got inf$"),
    ({"zero_optimization": {"stage3_max_live_parameters": float("inf")}},
     r"^deepspeed zero_optimization.stage3_max_live_parameters: .* got inf$"),
    ({"optimizer": {"type": "Adam", "params": {"betas": [0.9, float("nan")]}}},
     r"^deepspeed optimizer.params.betas: .* got nan$"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": float("-inf")}}},
     r"^deepspeed scheduler.params.warmup_min_lr: .* got -inf$"),
])
def test_nan_and_infinity_floats_are_refused_naming_the_key(ds, match):
    with pytest.raises(zjax.ConfigError, match=match.replace(".* got", "expected a finite "
                                                             "number, got")):
        from_deepspeed(ds, n_data=8)


def _nested(key: str, value) -> dict:
    """``{"a": {"b": value}}`` of ``"a.b"``."""
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


INTEGER_KEYS = ["train_batch_size", "train_micro_batch_size_per_gpu",
                "gradient_accumulation_steps", "steps_per_print", "zero_optimization.stage",
                "zero_optimization.sub_group_size", "zero_optimization.mics_shard_size",
                "zero_optimization.zero_hpz_partition_size",
                "zero_optimization.stage3_param_persistence_threshold",
                "zero_optimization.stage3_max_live_parameters",
                "zero_optimization.stage3_prefetch_bucket_size",
                "zero_optimization.offload_optimizer.buffer_count",
                "scheduler.params.warmup_num_steps", "scheduler.params.total_num_steps"]


@pytest.mark.parametrize("key", INTEGER_KEYS)
def test_integer_keys_refuse_fractions_and_booleans(key):
    """2.5 was truncated to 2 (1.7 to 1) and true passed as 1; 2.0 is the integer 2."""
    def ds(value):
        out = _nested(key, value)
        if key.startswith("scheduler"):
            out["scheduler"]["type"] = "WarmupLR"
        return out
    for value, got in [(2.5, "2.5"), (1.7, "1.7"), (True, "True")]:
        kind = "a number" if value is True else "an integer"
        with pytest.raises(zjax.ConfigError, match=rf"^deepspeed {re.escape(key)}: expected "
                                                   rf"{kind}, got {got}$"):
            from_deepspeed(ds(value), n_data=8)
    assert from_deepspeed(ds(2.0), n_data=8).overrides == from_deepspeed(ds(2), n_data=8).overrides


@pytest.mark.parametrize(("content", "match"), [
    (b"", r"is empty"),
    (b"  // comments only\n# and more\n", r"is empty"),
    (b"\x00\x9f\xff\xfe garbage", r"is not UTF-8 text"),
    (b"\x00\x01 garbage", r"holds text \(.*\), expected a JSON object"),
    (b"[1, 2]", r"holds a list \(\[1, 2\]\), expected a JSON"),
    (b"3", r"holds a number \(3\), expected a JSON"),
    (b'{"a": 1 /* never closed', r"ends inside a /\* comment"),
    (b'{"train_batch_size": 1e400}', r"a number too large"),
    (b"[" * 100_000, r"nested too deeply"),
    (b'{"gradient_clipping": NaN, "steps_per_print": 5}',
     r"at line 1, column \d+: .*NaN and Infinity are not JSON numbers"),
    (b'{"zero_optimization": {"stage": 3}', r"not valid JSON at line 1, column \d+: "),
])
def test_every_bad_file_is_one_config_error_naming_the_file(tmp_path, content, match):
    (tmp_path / "ds.json").write_bytes(content)
    with pytest.raises(zjax.ConfigError, match=r"^--deepspeed: '.*ds.json'.*" + match) as e:
        read_deepspeed(tmp_path / "ds.json")
    assert "\n" not in str(e.value)


def test_cli_refuses_a_duplicated_key_in_one_line_and_writes_nothing(tmp_path):
    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 2, // two\n'
                                      '                       "stage": 3}}')
    out = tmp_path / "zjax.yaml"
    r = zjax_main("config", "from-deepspeed", str(tmp_path / "ds.json"), "configs/tiny.yaml",
                  "-o", str(out))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    lines = [x for x in r.stderr.strip().splitlines() if x.startswith("zjax")]
    assert len(lines) == 1 and r.stderr.strip().endswith(lines[0]), r.stderr[-2000:]
    assert lines[0].startswith("zjax: error: --deepspeed: ") and "ds.json" in lines[0]
    assert "key zero_optimization.stage appears more than once" in lines[0]
    assert not out.exists() and r.stdout == ""


@pytest.mark.slow
def test_train_with_the_articles_sample(tmp_path):
    """`zjax train --deepspeed`: ZeRO-3 with both offloads, as the article configures it."""
    (tmp_path / "ds.json").write_text(ARTICLE)
    # the article's persistence threshold (1e5) keeps every leaf of the tiny GPT whole
    r = zjax_main("train", "--deepspeed", str(tmp_path / "ds.json"), "configs/tiny.yaml",
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


def test_activation_checkpointing_maps_to_zero_r_and_refuses_a_string_flag():
    ds = {"zero_optimization": {"stage": 3},
          "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True,
                                       "number_checkpoints": 4, "profile": False}}
    imported = from_deepspeed(ds, n_data=8)
    assert "zero.partition_activations=true" in imported.overrides
    assert "zero.offload_activations=true" in imported.overrides
    assert [k for k, _ in imported.ignored if k.startswith("activation")] == [
        "activation_checkpointing.number_checkpoints", "activation_checkpointing.profile"]
    # any stage: a stage-2 config with CPU checkpointing loads (it was refused below stage 3)
    config, _ = _config({"zero_optimization": {"stage": 2},
                         "activation_checkpointing": {"cpu_checkpointing": True}})
    assert config.zero.stage == 2 and config.zero.offload_activations
    with pytest.raises(ConfigError, match="cpu_checkpointing: expected true or false, got 'false'"):
        from_deepspeed({"activation_checkpointing": {"cpu_checkpointing": "false"}}, n_data=8)
    with pytest.raises(ConfigError, match="did you mean"):
        from_deepspeed({"activation_checkpointing": {"cpu_checkpionting": True}}, n_data=8)
