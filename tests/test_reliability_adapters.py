"""Issue 67, adapters and LoRA (defects 1-9): LoRA over every base ``train.init_from`` takes
(a Hugging Face directory, a ``zjax import-hf`` directory, a params export) merges on
``export --format hf``; a quantized base takes ``lora.init_adapter``; DeepSeek's latent
attention takes adapters (PEFT's module names); a PEFT adapter loads exactly as PEFT applies
it (regex ``target_modules``, ``layers_to_transform``) or is refused in one line naming the
file and the field or tensor, with the key the user set.

The reference for "as PEFT applies it" is PEFT's own formula on the Hugging Face tensors
(``W + lora_alpha / r * lora_B @ lora_A``, per adapted module) through the float64 numpy
forwards of ``hf_reference`` / ``hf_deepseek``; tolerances as there (1e-4 on logits).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from helpers import zjax_main
from hf_deepseek import deepseek_config, deepseek_logits, deepseek_tensors
from hf_reference import logits, random_tensors, tiny_config, write_checkpoint
from safetensors.numpy import save_file

from zjax.hf import SafetensorsDir

TOKENS = np.array([[1, 5, 9, 200, 13, 7, 42, 3]], np.int32)
ATOL = 1e-4
PREFIX = "base_model.model."
RUN = ["data.path=", "data.seq_len=32", "data.batch_size=8", "train.eval_every=0",
       "logging.progress=false", "optimizer.lr=0.01", "optimizer.warmup_steps=0",
       "lora.rank=4", "lora.alpha=8"]


def _ok(result) -> None:
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-3000:])
    assert "Traceback" not in result.stderr and "damaged" not in result.stderr, result.stderr


def _one_error(result, *needles: str) -> str:
    """Exit 2 and one line on stderr, ``zjax: error: ...``, holding every needle."""
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert result.returncode == 2 and lines and lines[-1].startswith("zjax: error: "), (
        result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in lines[-1], lines[-1]
    return lines[-1]


def _wordlevel(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, **{f"w{i}": i for i in range(1, 256)}},
                                     unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))


def _tensors(directory: Path) -> dict[str, np.ndarray]:
    files = SafetensorsDir(directory)
    return {n: np.asarray(files.array(n), np.float64) for n in files.names()}


def peft_merged(base: dict[str, np.ndarray], adapter: Path) -> dict[str, np.ndarray]:
    """PEFT's merge of ``adapter`` into ``base`` (Hugging Face tensors), computed here."""
    meta = json.loads((adapter / "adapter_config.json").read_text())
    scale = meta["lora_alpha"] / meta["r"]
    factors, out = _tensors(adapter), dict(base)
    for name, a in factors.items():
        if name.endswith(".lora_A.weight"):
            module = name[len(PREFIX):-len(".lora_A.weight")]
            b = factors[name.replace(".lora_A.", ".lora_B.")]
            out[f"{module}.weight"] = out[f"{module}.weight"] + scale * b @ a
    return out


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny Llama (every linear input a multiple of 64, for the quantized bases) with a
    tokenizer, its ``zjax import-hf`` directory, a 2-step LoRA run over the import, and that
    run's adapters as PEFT's directory (float32)."""
    tmp = tmp_path_factory.mktemp("adapters_llama")
    hf = tiny_config("llama", intermediate_size=128)
    tensors = random_tensors(hf)
    directory = write_checkpoint(tmp / "hf", hf, tensors)
    _wordlevel(directory / "tokenizer.json")
    _ok(zjax_main("import-hf", directory, tmp / "import"))
    _ok(zjax_main("train", tmp / "import" / "zjax.yaml", *RUN, "train.steps=2",
                  "checkpoint.every=2", "--run-dir", tmp / "run"))
    _ok(zjax_main("export", tmp / "run", tmp / "peft", "--format", "peft", "--dtype",
                  "float32"))
    return {"hf": hf, "tensors": tensors, "dir": directory, "import": tmp / "import",
            "run": tmp / "run", "peft": tmp / "peft", "tmp": tmp}


@pytest.fixture(scope="module")
def deepseek_import(tmp_path_factory):
    """A tiny DeepSeek-V3 (a dense first layer, latent attention with a query latent, shared
    experts) and its import."""
    tmp = tmp_path_factory.mktemp("adapters_deepseek")
    hf = deepseek_config()
    tensors = deepseek_tensors(hf)
    directory = write_checkpoint(tmp / "hf", hf, tensors)
    _ok(zjax_main("import-hf", directory, tmp / "import"))
    return {"hf": hf, "tensors": tensors, "dir": directory, "import": tmp / "import",
            "tmp": tmp}


@pytest.fixture(scope="module")
def deepseek(deepseek_import):
    """``deepseek_import`` with a 1-step LoRA run over it on every linear module (apart: the
    quick loop's refusal needs no run)."""
    run = deepseek_import["tmp"] / "run"
    _ok(zjax_main("train", deepseek_import["import"] / "zjax.yaml", *RUN, "train.steps=1",
                  "checkpoint.every=1", "--run-dir", run))
    return {**deepseek_import, "run": run}


# ---- 1: export --format hf merges over every base train.init_from takes ---------------------

def _with_base(run: Path, base: Path, out: Path) -> Path:
    """A copy of the LoRA run ``run`` whose config names ``base`` as its train.init_from."""
    shutil.copytree(run, out)
    config = yaml.safe_load((out / "config.yaml").read_text())
    config["train"]["init_from"] = str(base)
    (out / "config.yaml").write_text(yaml.safe_dump(config))
    return out


@pytest.mark.slow  # three exports and PEFT's merge (14 s); the quick loop keeps the faults
def test_lora_over_an_import_exports_the_merged_model_from_every_kind_of_base(llama, tmp_path):
    """The run started from an import; the same weights as a Hugging Face directory and as a
    params export (the import's ``params/``) merge to the same files, PEFT's merge of the
    run's adapters."""
    want = peft_merged(llama["tensors"], llama["peft"])
    assert np.abs(want["model.layers.1.self_attn.q_proj.weight"]
                  - llama["tensors"]["model.layers.1.self_attn.q_proj.weight"]).max() > 1e-5
    bases = {"import": llama["run"],
             "hf": _with_base(llama["run"], llama["dir"], tmp_path / "run_hf"),
             "params": _with_base(llama["run"], llama["import"] / "params",
                                  tmp_path / "run_params")}
    for kind, run in bases.items():
        result = zjax_main("export", run, tmp_path / f"merged_{kind}", "--format", "hf",
                           "--dtype", "float32")
        _ok(result)
        got = _tensors(tmp_path / f"merged_{kind}")
        assert sorted(got) == sorted(want), kind
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-6,
                                       err_msg=f"{kind}: {name}")


def test_an_unreadable_base_is_named_and_the_run_s_checkpoints_are_not_called_damaged(
        llama, tmp_path):
    params = tmp_path / "params"
    shutil.copytree(llama["import"] / "params", params)
    for f in params.rglob("*"):  # every array's data gone: the base, not the checkpoint
        if f.is_file() and f.parent.name == "d":
            f.unlink()
    run = _with_base(llama["run"], params, tmp_path / "run")
    result = zjax_main("export", run, tmp_path / "out", "--format", "hf")
    line = _one_error(result, "train.init_from", str(params), "nothing is wrong with the run's")
    assert "damaged (" not in result.stderr and "falling back" not in result.stderr, line
    assert not (tmp_path / "out").exists()


# ---- 2: a quantized base with lora.init_adapter ---------------------------------------------

@pytest.mark.slow  # a QLoRA step per format (10 s each)
@pytest.mark.parametrize("base_dtype", ["nf4", "int8"])
def test_a_quantized_base_starts_from_a_peft_adapter(llama, tmp_path, base_dtype):
    """One step at a learning rate too small to move anything: the adapters written back
    are the PEFT file's."""
    run = tmp_path / "run"
    _ok(zjax_main("train", llama["import"] / "zjax.yaml", *RUN, "train.steps=1",
                  "optimizer.lr=1e-12", f"lora.base_dtype={base_dtype}",
                  f"lora.init_adapter={llama['peft']}", "checkpoint.every=1", "--run-dir",
                  run))
    _ok(zjax_main("export", run, tmp_path / "again", "--format", "peft", "--dtype", "float32"))
    want, got = _tensors(llama["peft"]), _tensors(tmp_path / "again")
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], atol=1e-9, rtol=0, err_msg=name)


# ---- 3: DeepSeek's latent attention takes adapters ------------------------------------------

@pytest.mark.slow  # a DeepSeek import trained and exported (19 s)
def test_lora_on_deepseek_adapts_latent_attention_and_shared_experts_as_peft(deepseek,
                                                                          tmp_path):
    """Every linear module, by PEFT's names: the PEFT export has one pair per module with
    the file's layer numbers (the dense layer 0, the mixture's 1 and 2); the base with that
    adapter (``zjax sample --adapter``'s model) and the merged export both compute PEFT's
    merge of it."""
    from zjax.export.sample import load_sampler

    _ok(zjax_main("export", deepseek["run"], tmp_path / "peft", "--format", "peft", "--dtype",
                  "float32"))
    _ok(zjax_main("export", deepseek["run"], tmp_path / "merged", "--format", "hf", "--dtype",
                  "float32"))
    names = set(_tensors(tmp_path / "peft"))
    meta = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert meta["target_modules"] == ["down_proj", "gate_proj", "kv_a_proj_with_mqa",
                                      "kv_b_proj", "o_proj", "q_a_proj", "q_b_proj", "up_proj"]
    hf = deepseek["hf"]
    per_layer = {0: 8, 1: 5 + 3 * (hf["n_routed_experts"] + 1),
                 2: 5 + 3 * (hf["n_routed_experts"] + 1)}  # modules: attention 5, MLPs
    for i, modules in per_layer.items():
        assert len([n for n in names if f".layers.{i}." in n]) == 2 * modules, i
    assert f"{PREFIX}model.layers.2.mlp.shared_experts.down_proj.lora_B.weight" in names
    want = deepseek_logits(hf, peft_merged(deepseek["tensors"], tmp_path / "peft"), TOKENS)
    base = deepseek_logits(hf, deepseek["tensors"], TOKENS)
    assert np.abs(want - base).max() > 1e-2  # the adapters trained
    model = load_sampler(deepseek["dir"], adapter=tmp_path / "peft").model
    np.testing.assert_allclose(np.asarray(model(TOKENS), np.float64), want, atol=ATOL, rtol=0)
    merged = deepseek_logits(hf, _tensors(tmp_path / "merged"), TOKENS)
    np.testing.assert_allclose(merged, want, atol=ATOL, rtol=0)


def test_a_target_deepseek_does_not_have_is_refused_by_key(deepseek_import, tmp_path):
    result = zjax_main("train", deepseek_import["import"] / "zjax.yaml", *RUN, "train.steps=1",
                       "lora.targets=[k_proj,o_proj]", "--run-dir", tmp_path / "run")
    _one_error(result, "lora.targets: k_proj", "kv_a_proj_with_mqa")


# ---- 4-9: a PEFT adapter loads exactly, or is refused by file and field ---------------------

REMOVED = object()


def _adapter(source: Path, out: Path, *, config: dict | None = None, drop: tuple = (),
             tensors: dict | None = None, raw: bytes | None = None) -> Path:
    """A copy of the PEFT directory ``source`` with its config updated by ``config`` (a value
    ``REMOVED`` removes the key), tensors dropped or set, or its safetensors file replaced by
    ``raw`` bytes."""
    shutil.copytree(source, out)
    meta = json.loads((out / "adapter_config.json").read_text())
    for key, value in (config or {}).items():
        meta.pop(key, None) if value is REMOVED else meta.__setitem__(key, value)
    (out / "adapter_config.json").write_text(json.dumps(meta))
    file = out / "adapter_model.safetensors"
    if raw is not None:
        file.write_bytes(raw)
    elif drop or tensors:
        current = {n: v.astype(np.float32) for n, v in _tensors(out).items() if n not in drop}
        save_file({**current, **(tensors or {})}, file)
    return out


def _sample(llama, adapter: Path):
    return zjax_main("sample", llama["import"], "--adapter", adapter, "--prompt", "w1 w2 w3",
                     "--max-new-tokens", "2", "--temperature", "0")


Q0 = f"{PREFIX}model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("case, needles", [
    ({"config": {"use_dora": True}}, ["adapter_config.json", "use_dora"]),
    ({"tensors": {f"{Q0}.lora_magnitude_vector": np.ones(64, np.float32)}},
     ["lora_magnitude_vector", "DoRA"]),
    ({"config": {"alpha_pattern": {"q_proj": 32}}}, ["alpha_pattern", "own alpha"]),
    ({"config": {"rank_pattern": {"q_proj": 8}}}, ["rank_pattern", "own rank"]),
    ({"config": {"bias": "lora_only"},
      "tensors": {f"{Q0}.bias": np.zeros(64, np.float32)}}, ["q_proj.bias", "bias"]),
    ({"config": {"bias": "all"}, "tensors": {"base_model.model.model.norm.bias":
                                             np.zeros(64, np.float32)}}, ["norm.bias"]),
    ({"config": {"modules_to_save": ["lm_head"]}}, ["modules_to_save"]),
    ({"config": {"r": 8}}, ["lora_A.weight", "rank 4", "r 8"]),
    ({"tensors": {f"{PREFIX}model.layers.7.self_attn.q_proj.lora_A.weight":
                  np.zeros((4, 64), np.float32)}}, ["layers.7.", "no module"]),
    ({"config": {"r": REMOVED}}, ["adapter_config.json", "r is None"]),
    ({"config": {"lora_alpha": None}}, ["adapter_config.json", "lora_alpha is None"]),
    ({"tensors": {f"{Q0}.lora_A.weight": np.zeros((4, 80), np.float32)}},
     [f"{Q0}.lora_A.weight", "[4, 80]", "expected [4, 64]"]),
    ({"drop": (f"{Q0}.lora_B.weight",)}, [f"{Q0}.lora_B.weight", "incomplete"]),
    ({"config": {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}},
     ["mlp.", "lora_A.weight", "leaves out"]),
    ({"raw": b"garbage, not safetensors"}, ["adapter_model.safetensors", "not a safetensors"]),
    ({"config": {"target_modules": "(unclosed"}}, ["target_modules", "not a regular expr"]),
    ({"config": {"peft_type": "IA3"}}, ["peft_type 'IA3'"]),
], ids=["dora", "dora-tensor", "alpha_pattern", "rank_pattern", "bias-lora_only", "bias-all",
        "modules_to_save", "r-mismatch", "extra-layer", "no-r", "alpha-null", "wrong-width",
        "missing-tensor", "targets-leave-out", "garbage", "bad-regex", "not-lora"])
def test_an_adapter_zjax_cannot_apply_exactly_is_refused_naming_field_or_tensor(
        llama, tmp_path, case, needles):
    result = _sample(llama, _adapter(llama["peft"], tmp_path / "adapter", **case))
    _one_error(result, "--adapter: ", *needles)


def test_a_truncated_adapter_file_is_refused(llama, tmp_path):
    raw = (llama["peft"] / "adapter_model.safetensors").read_bytes()
    result = _sample(llama, _adapter(llama["peft"], tmp_path / "adapter", raw=raw[:-100]))
    _one_error(result, "adapter_model.safetensors", "truncated")


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_a_non_finite_adapter_is_refused_by_sample_and_by_training(llama, tmp_path, value):
    """Refused on load, by ``zjax sample --adapter`` and by a run's ``lora.init_adapter``
    (whose messages name that key, not sample's flag, nor ``optimizer.lr``)."""
    bad = np.zeros((4, 64), np.float32)
    bad[1, 2] = value
    adapter = _adapter(llama["peft"], tmp_path / "adapter",
                       tensors={f"{Q0}.lora_A.weight": bad})
    _one_error(_sample(llama, adapter), "--adapter: ", f"{Q0}.lora_A.weight",
               "1 NaN or infinite value")
    if np.isinf(value):  # a training run, once (the same check)
        return
    result = zjax_main("train", llama["import"] / "zjax.yaml", *RUN, "train.steps=1",
                       f"lora.init_adapter={adapter}", "--run-dir", tmp_path / "run")
    line = _one_error(result, "lora.init_adapter: ", f"{Q0}.lora_A.weight")
    assert "optimizer.lr" not in line and "--adapter" not in line


def test_init_adapter_errors_name_the_key_the_user_set(llama, tmp_path):
    from zjax.config import load_config
    from zjax.errors import CheckpointError
    from zjax.hf import layout_for_model, read_peft

    config = load_config(llama["import"] / "zjax.yaml")
    with pytest.raises(CheckpointError, match=r"^lora.init_adapter: .*nothing is not a dir"):
        read_peft(tmp_path / "nothing", layout_for_model(config.loop, config.model),
                  config.model, key="lora.init_adapter")


def _adapted_logits(llama, adapter: Path) -> np.ndarray:
    from zjax.export.sample import load_sampler

    return np.asarray(load_sampler(llama["import"], adapter=adapter).model(TOKENS), np.float64)


@pytest.mark.parametrize("config, layers", [
    ({"target_modules": r".*\.(q|k|v|o|gate|up|down)_proj"}, (0, 1)),
    ({"target_modules": r"model\.layers\.1\..*"}, (1,)),
    ({"layers_to_transform": [0]}, (0,)),
    ({"target_modules": "all-linear", "exclude_modules": r".*layers\.0\..*"}, (1,)),
], ids=["regex-all", "regex-layer-1", "layers_to_transform", "all-linear-exclude"])
def test_peft_s_target_forms_apply_the_modules_peft_adapts(llama, tmp_path, config, layers):
    """The regex and layer forms of ``target_modules`` (PEFT matches a string with
    ``re.fullmatch`` on module names): the modules they leave out are the base's, as in
    PEFT. The file holds only the adapted modules' tensors, as PEFT writes it."""
    every = _tensors(llama["peft"])
    kept = {n for n in every if any(f".layers.{i}." in n for i in layers)}
    adapter = _adapter(llama["peft"], tmp_path / "adapter", config=config,
                       drop=tuple(sorted(set(every) - kept)))
    want = logits(llama["hf"], peft_merged(llama["tensors"], adapter), TOKENS)
    np.testing.assert_allclose(_adapted_logits(llama, adapter), want, atol=ATOL, rtol=0)
    result = _sample(llama, adapter)
    _ok(result)
    assert result.stdout.strip(), result.stdout


# ---- noticed: a random base is said; a resume cannot change what the adapters mean ---------

@pytest.mark.slow
def test_lora_over_no_base_says_it_trains_a_random_one(tmp_path):
    result = zjax_main("train", "configs/tiny.yaml", *RUN, "train.steps=1", "--run-dir",
                       tmp_path / "run")
    _ok(result)
    assert "no train.init_from: the adapters train over a random base" in result.stdout


@pytest.mark.parametrize("change", ["lora.alpha=16",
                                    pytest.param("lora.rslora=true", marks=pytest.mark.slow)])
def test_a_resume_with_another_adapter_scale_is_refused_and_changes_nothing(llama, tmp_path,
                                                                          change):
    run = tmp_path / "run"
    shutil.copytree(llama["run"], run)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    result = zjax_main("train", llama["import"] / "zjax.yaml", *RUN, "train.steps=3",
                       "checkpoint.every=2", change, "--run-dir", run)
    _one_error(result, f"{change.split('=')[0]}: ", "the checkpoint's adapters were trained")
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
