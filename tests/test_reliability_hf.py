"""Hugging Face import under hostile or merely unusual input (issue 50, items 6, 10, 12, 13):
a config.json key left out reads as transformers reads it (its class's default, checked
against transformers' own classes, family by family), a damaged safetensors header or index
is one error line naming the file and the tensor, an import pins only the keys that shape or
give meaning to its weights, and the model's whole context is its max_seq_len. Sampling
(items 7, 8) is in tests/test_reliability_hf_sample.py."""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import re
import struct
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_reference import FAMILIES, random_tensors, tiny_config, write_checkpoint

from zjax import cli
from zjax.config import load_config
from zjax.errors import CheckpointError, ConfigError
from zjax.export.sample import generate, load_sampler
from zjax.hf import HFCheckpoint, SafetensorsDir, import_hf, initial_params
from zjax.hf._defaults import DEFAULTS
from zjax.hf._layouts import layout_for_hf
from zjax.hf._load import model_shapes
from zjax.hf._pinned import GPT2_FREE, GPT2_PINNED, LLAMA_FREE, LLAMA_PINNED
from zjax.models import GPTConfig, LlamaConfig

ROOT = Path(__file__).resolve().parents[1]
CLASSES = {"llama": "LlamaConfig", "mistral": "MistralConfig", "mixtral": "MixtralConfig",
           "qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "qwen3_moe": "Qwen3MoeConfig",
           "phi3": "Phi3Config", "gemma": "GemmaConfig", "gemma2": "Gemma2Config",
           "gemma3_text": "Gemma3TextConfig", "gpt2": "GPT2Config",
           "deepseek_v3": "DeepseekV3Config", "deepseek_v2": "DeepseekV2Config"}


def _cli(capsys, *args: str) -> tuple[int, list[str]]:
    rc = cli.main([str(a) for a in args])
    captured = capsys.readouterr()
    return rc, captured.err.strip().splitlines()


def _one_error(rc: int, err: list[str], *needles: str) -> str:
    assert rc == 2 and len(err) == 1 and err[0].startswith("zjax: error: "), (rc, err)
    for needle in needles:
        assert needle in err[0], err[0]
    return err[0]


def _llama_dir(directory: Path, **changes) -> Path:
    hf = tiny_config("llama", **changes)
    return write_checkpoint(directory, hf, random_tensors(hf))


def _wordlevel(path: Path, n: int = 256, eos: str | None = None) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, **{f"w{i}": i for i in range(1, n)}},
                                     unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    if eos is not None:
        (path.parent / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}))
    return path


# ---- item 6: an absent key is transformers' class default ---------------------------------

def _signature(cls) -> dict:
    return {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items()
            if p.default is not inspect.Parameter.empty}


@pytest.mark.parametrize("model_type", sorted(DEFAULTS))
def test_the_defaults_table_is_transformers_class_defaults(model_type):
    import transformers

    cls = getattr(transformers, CLASSES[model_type])
    own, base = _signature(cls), _signature(transformers.PretrainedConfig)
    for key, value in DEFAULTS[model_type].items():
        assert key in own or key in base, f"{model_type}: {key} is not a {cls.__name__} key"
        want = own[key] if key in own else base[key]
        assert value == want and type(value) is type(want), (model_type, key, value, want)


def _read(layout, hf: dict):
    """The model section of ``hf``, or the reason it is refused (the same config refused the
    same way either way: 32 key/value heads of Qwen2's default for 4 query heads)."""
    try:
        return layout.from_hf(hf, source="config.json")
    except CheckpointError as e:
        return str(e)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_key_left_out_reads_as_transformers_reads_it(family):
    """For every key of the family's config class: a config.json without it reads as one
    holding the value transformers' class gives it (derived ones included), or is refused
    where transformers' class refuses it."""
    import transformers

    cls = getattr(transformers, FAMILIES[family][0])
    hf = tiny_config(family)
    layout = layout_for_hf(hf, source="config.json")
    keys = [*_signature(cls), "tie_word_embeddings"]
    compared = 0
    for key in dict.fromkeys(keys):
        absent = {k: v for k, v in hf.items() if k != key}
        try:
            theirs = getattr(cls(**absent), key)
        except ValueError:  # transformers refuses it (layer_types of another length)
            with pytest.raises(CheckpointError):
                layout.from_hf(absent, source="config.json")
            continue
        explicit = {**absent, key: theirs}
        assert _read(layout, absent) == _read(layout, explicit), (family, key, theirs)
        compared += 1
    assert compared >= 15, (family, compared)


@pytest.mark.parametrize(("family", "drop", "field", "want"), [
    ("gemma2", "attn_logit_softcapping", "attn_softcap", 50.0),
    ("gemma2", "final_logit_softcapping", "final_softcap", 30.0),
    ("mistral", "sliding_window", "sliding_window", 4096),
    ("qwen3", "head_dim", "head_dim", 128),
    ("gemma", "head_dim", "head_dim", 256),
    ("llama", "head_dim", "head_dim", None),  # derived: hidden_size // heads
    ("qwen2", "num_key_value_heads", "n_kv_heads", None),  # 32: refused (4 heads)
    ("mixtral", "rope_theta", "rope_theta", 1e6),
    ("phi3", "rms_norm_eps", "norm_eps", 1e-5),
    ("llama", "tie_word_embeddings", "tie_embeddings", False),
    ("gemma3", "max_position_embeddings", "max_seq_len", 131072),
])
def test_the_issues_examples_and_their_siblings(family, drop, field, want):
    hf = {k: v for k, v in tiny_config(family).items() if k != drop}
    layout = layout_for_hf(hf, source="c")
    if family == "qwen2":
        with pytest.raises(CheckpointError, match="n_kv_heads: 32 does not divide"):
            layout.from_hf(hf, source="c")
        return
    assert getattr(layout.from_hf(hf, source="c"), field) == want


def test_gemma2_and_3_configs_with_hidden_act_import():
    """Hub Gemma 2 / 3 configs carry hidden_act beside hidden_activation (which their model
    reads): not held to Llama's silu."""
    for family in ("gemma2", "gemma3"):
        hf = tiny_config(family, hidden_act="gelu_pytorch_tanh")
        assert layout_for_hf(hf, source="c").from_hf(hf, source="c").mlp_activation == "gelu_tanh"


def test_a_shape_default_that_does_not_fit_the_tensors_is_named(tmp_path):
    """Qwen3 without head_dim is 128-wide (transformers'); tensors of another width are
    refused naming the key left out and the default taken; tensors 128 wide import."""
    hf = tiny_config("qwen3")  # head_dim 24
    directory = write_checkpoint(tmp_path / "q", {k: v for k, v in hf.items()
                                                  if k != "head_dim"}, random_tensors(hf))
    with pytest.raises(CheckpointError, match=r"leaves out head_dim \(default 128\)"):
        HFCheckpoint(directory)
    wide = tiny_config("qwen3", head_dim=128)
    directory = write_checkpoint(tmp_path / "w", {k: v for k, v in wide.items()
                                                  if k != "head_dim"}, random_tensors(wide))
    assert HFCheckpoint(directory).config.head_dim == 128


def test_the_docs_table_is_the_codes():
    text = (ROOT / "docs" / "hf-defaults.md").read_text()
    rows = dict(re.findall(r"^\| `([a-z0-9_]+)` \(\w+Config\) \| (.*) \|$", text, re.M))
    assert set(rows) == set(DEFAULTS)
    for model_type, table in DEFAULTS.items():
        cells = dict(re.findall(r"`(\w+)`: ([^,]+)", rows[model_type]))
        assert {k: json.loads(v) for k, v in cells.items()} == table, model_type


# ---- item 10: a damaged safetensors header is one line naming the file and the tensor --------

_T = "model.embed_tokens.weight"


def _header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _write(path: Path, header: bytes, data: bytes) -> None:
    header += b" " * (-len(header) % 8)
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


def _edit(entry_change):
    def edit(path: Path) -> None:
        header, data = _header(path)
        entry_change(header[_T])
        _write(path, json.dumps(header).encode(), data)
    return edit


def _raw(blob: bytes):
    return lambda path: _write(path, blob, _header(path)[1])


def _short(entry: dict) -> None:
    entry["data_offsets"][1] -= 4


def _shift(entry: dict) -> None:
    entry["data_offsets"] = [x + 10**9 for x in entry["data_offsets"]]


DAMAGE = {
    "no shape": (_edit(lambda e: e.pop("shape")), "has shape None"),
    "no dtype": (_edit(lambda e: e.pop("dtype")), "has dtype None"),
    "unknown dtype": (_edit(lambda e: e.update(dtype="Q4")), "has dtype 'Q4'"),
    "shape not a list": (_edit(lambda e: e.update(shape="abc")), "has shape 'abc'"),
    "negative size": (_edit(lambda e: e.update(shape=[-1, 64])), "has shape [-1, 64]"),
    "float size": (_edit(lambda e: e.update(shape=[2.5, 64])), "has shape [2.5, 64]"),
    "no offsets": (_edit(lambda e: e.pop("data_offsets")), "has data_offsets None"),
    "offsets reversed": (_edit(lambda e: e.update(data_offsets=e["data_offsets"][::-1])),
                         "0 <= begin <= end"),
    "offsets past the file": (_edit(_shift), "does not fit its offsets"),
    "offsets not shape x dtype": (_edit(_short), "bytes) has data_offsets"),
    "entry not an object": (_edit(lambda e: e.clear()), "has dtype None"),
}
HEADERS = {
    "header a JSON list": (_raw(b"[1, 2]"), "JSON list"),
    "header not JSON": (_raw(b"\xff\xfe{garbage"), "not JSON"),
    "header longer than the file": (
        lambda p: p.write_bytes(struct.pack("<Q", 10**7) + p.read_bytes()[8:]), "header size"),
    "file of 3 bytes": (lambda p: p.write_bytes(b"abc"), "header size reads -1"),
}


@pytest.mark.parametrize("case", sorted(DAMAGE) + sorted(HEADERS))
def test_a_damaged_header_is_refused_naming_file_and_tensor(tmp_path, capsys, cli_logging,
                                                             case):
    damage, needle = {**DAMAGE, **HEADERS}[case]
    directory = _llama_dir(tmp_path / "hf")
    path = directory / "model.safetensors"
    damage(path)
    names = [str(path), needle] + ([repr(_T)] if case in DAMAGE else [])
    with pytest.raises(CheckpointError) as e:
        SafetensorsDir(directory)
    for name in names:
        assert name in str(e.value), str(e.value)
    rc, err = _cli(capsys, "import-hf", directory, tmp_path / "out")
    _one_error(rc, err, *names)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("index", "needle"), [
    ('{"weight_map": ["model.safetensors"]}', "weight_map is not an object"),
    ('{"weight_map": {"x": "../elsewhere.safetensors"}}', "weight_map is not an object"),
    ('{"weight_map": {"x": 3}}', "weight_map is not an object"),
    ("[]", "not a safetensors index"),
    ("{", "not a safetensors index"),
])
def test_a_damaged_index_is_refused_naming_it(tmp_path, capsys, cli_logging, index, needle):
    directory = _llama_dir(tmp_path / "hf")
    (directory / "model.safetensors").rename(directory / "model-00001-of-00001.safetensors")
    (directory / "model.safetensors.index.json").write_text(index)
    rc, err = _cli(capsys, "import-hf", directory, tmp_path / "out")
    _one_error(rc, err, "model.safetensors.index.json", needle)


@pytest.mark.parametrize("config", ["[1, 2]", '"llama"', "\xff"])
def test_a_config_json_that_is_not_an_object_is_one_line(tmp_path, capsys, cli_logging, config):
    directory = _llama_dir(tmp_path / "hf")
    (directory / "config.json").write_bytes(config.encode("latin-1"))
    rc, err = _cli(capsys, "import-hf", directory, tmp_path / "out")
    _one_error(rc, err, "config.json")


@pytest.mark.parametrize(("key", "value", "needle"), [
    ("num_hidden_layers", "two", "num_hidden_layers = 'two'; expected an integer"),
    ("hidden_size", 64.5, "hidden_size = 64.5; expected an integer"),
    ("rope_theta", None, "rope_theta = None; expected a number"),
    ("tie_word_embeddings", "false", "tie_word_embeddings = 'false'; expected true or false"),
    ("num_key_value_heads", [2], "num_key_value_heads = [2]; expected an integer or null"),
    ("num_hidden_layers", 1e400, "num_hidden_layers = inf"),
    ("num_attention_heads", 0, "num_attention_heads = 0; expected an integer >= 1"),
    ("num_hidden_layers", 0, "model.n_layers: must be > 0, got 0"),
])
def test_a_config_value_of_the_wrong_kind_is_named(tmp_path, capsys, cli_logging, key, value,
                                                   needle):
    directory = _llama_dir(tmp_path / "hf")
    hf = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**hf, key: value}))
    rc, err = _cli(capsys, "import-hf", directory, tmp_path / "out")
    _one_error(rc, err, "config.json", needle)


# ---- item 12: an import pins only what shapes or gives meaning to its weights ----------------

RUNTIME = {"remat": "false", "max_seq_len": "512", "attention": "dense",
           "context_attention": "ring", "loss_chunk": "32", "mlp_chunk": "16",
           "moe_matmul": "tiled", "router_aux_loss_coef": "0.01",
           "router_z_loss_coef": "0.001", "capacity_factor": "1.5", "moe_exchange": "chunked",
           "moe_chunks": "2", "router_bias_update_speed": "0.001",
           "router_seq_aux_loss_coef": "0.0001", "mtp_loss_coef": "0.1", "fp8": "tensorwise"}
WEIGHTS = {"vocab_size": 264, "d_model": 128, "n_layers": 1, "d_ff": 96, "n_heads": 8,
           "n_kv_heads": 1, "head_dim": 32, "sliding_window": 7, "global_every": 2,
           "rope_theta": 12345.0, "local_rope_theta": 50.0, "rope_scaling": "llama3",
           "rope_factor": 3.0, "rope_low_freq_factor": 2.0, "rope_high_freq_factor": 5.0,
           "rope_original_max_len": 16, "rope_beta_fast": 16.0, "rope_beta_slow": 2.0,
           "rope_mscale": 1.0, "rope_mscale_all_dim": 0.5, "rope_attention_factor": 0.8,
           "attn_softcap": 7.0, "final_softcap": 7.0,
           "query_pre_attn_scalar": 64.0, "mlp_activation": "gelu", "norm_eps": 0.01,
           "n_experts": 8, "experts_per_token": 1, "n_shared_experts": 1, "moe_d_ff": 48,
           # DeepSeek-V3's (a tuple: the first value that differs from the base's and fits it)
           "router_score": "sigmoid", "router_groups": (1, 2), "router_topk_groups": (2, 1),
           "routed_scaling_factor": 2.0, "first_k_dense": 1, "kv_lora_rank": (8, 16),
           "q_lora_rank": (12, 24), "qk_nope_head_dim": 4, "qk_rope_head_dim": 2,
           "v_head_dim": 4, "rope_short_factor": [1.5] * 12, "rope_long_factor": [2.0] * 12,
           "mtp_layers": 1}


def test_every_model_field_is_pinned_or_free_by_decision():
    for cls, pinned, free in ((LlamaConfig, LLAMA_PINNED, LLAMA_FREE),
                              (GPTConfig, GPT2_PINNED, GPT2_FREE)):
        fields = {f.name for f in dataclasses.fields(cls)}
        assert not set(pinned) & set(free) and set(pinned) | set(free) == fields, cls
    assert set(RUNTIME) == set(LLAMA_FREE)
    assert {"attention", "context_attention", "mlp_chunk", "loss_chunk",
            "moe_matmul"} <= set(LLAMA_FREE)


def _target(cfg):
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    out: dict = {}
    for keys, shape in model_shapes(cfg).items():
        node = out
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=device)
    return out


def test_each_runtime_key_is_the_runs(tmp_path):
    out = import_hf(_llama_dir(tmp_path / "hf"), tmp_path / "out")
    for key, value in RUNTIME.items():
        model = load_config(out / "zjax.yaml", [f"model.{key}={value}"]).model
        assert str(getattr(model, key)).lower() == value, key
        params = initial_params(out, _target(model), model)
        assert params["embed"].shape == (256, 64), key


@pytest.mark.slow  # three checkpoints written and every pinned key tried (12 s)
def test_each_weight_key_is_refused_naming_why(tmp_path):
    from hf_deepseek import deepseek_config, deepseek_tensors

    bases = []
    for family in ("gemma3", "qwen3_moe"):
        hf = tiny_config(family)
        bases.append(write_checkpoint(tmp_path / family, hf, random_tensors(hf)))
    hf = deepseek_config()
    bases.append(write_checkpoint(tmp_path / "deepseek", hf, deepseek_tensors(hf)))
    for key, reason in LLAMA_PINNED.items():
        tried = 0
        for directory in bases:
            cfg = HFCheckpoint(directory).config
            value = WEIGHTS.get(key, not getattr(cfg, key))  # the flags: flipped
            if isinstance(value, tuple):
                value = next(v for v in value if v != getattr(cfg, key))
            if value == getattr(cfg, key):  # no change on this base (its own value)
                continue
            try:
                changed = dataclasses.replace(cfg, **{key: value})
            except ConfigError:  # not a model of this base (a window's keys on a mixture)
                continue
            with pytest.raises(ConfigError, match=rf"^model\.{key}: .* \(its config\.json; "
                                                  rf"{re.escape(reason)}\)"):
                initial_params(directory, None, changed)
            tried += 1
        assert tried, key


def test_gpt2_imports_pin_the_position_table_but_not_the_kernels(tmp_path):
    from hf_models import hf_gpt2, write_hf

    directory = write_hf(tmp_path / "gpt2", hf_gpt2())
    cfg = HFCheckpoint(directory).config
    for key, value in (("attention", "dense"), ("mlp_chunk", 16), ("loss_chunk", 32),
                       ("remat", False), ("context_attention", "ring")):
        changed = dataclasses.replace(cfg, **{key: value})
        assert initial_params(directory, _target(changed), changed)["pos"].shape == (64, 64)
    with pytest.raises(ConfigError, match=r"model\.max_seq_len: 128, .*position table"):
        initial_params(directory, None, dataclasses.replace(cfg, max_seq_len=128))


# ---- item 13: the model's whole context ------------------------------------------------------

def test_the_import_keeps_the_models_context_at_no_memory_cost(tmp_path):
    out = import_hf(_llama_dir(tmp_path / "hf", max_position_embeddings=131072), tmp_path / "o")
    config = load_config(out / "zjax.yaml")
    assert config.model.max_seq_len == 131072 and config.data.seq_len <= 131072
    short = dataclasses.replace(config.model, max_seq_len=64)
    assert model_shapes(config.model) == model_shapes(short)  # rotary has no position table
    sampler = load_sampler(out)  # the cache is the generation's length, not the context's
    tokens = generate(sampler.model, np.asarray([[1, 2, 3]]), max_new_tokens=4, temperature=0,
                      key=jax.random.key(0))
    assert tokens.shape == (1, 4)
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == 131072


def test_a_config_without_max_position_embeddings_reads_the_familys_context(tmp_path, caplog):
    hf = {k: v for k, v in tiny_config("qwen2").items() if k != "max_position_embeddings"}
    directory = write_checkpoint(tmp_path / "q", hf, random_tensors(tiny_config("qwen2")))
    with caplog.at_level(logging.INFO, logger="zjax"):
        assert HFCheckpoint(directory).config.max_seq_len == 32768
    assert "max_position_embeddings (default 32768)" in caplog.text
