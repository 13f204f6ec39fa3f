"""Gathered export: a program without zjax restores it on one device; logits match zjax's."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from helpers import cli_env, zjax_main

import zjax
from zjax.config import load_config
from zjax.export import export
from zjax.models import GPT

pytestmark = pytest.mark.slow  # compiles or trains at length: outside the fast loop

ROOT = Path(__file__).resolve().parent.parent
OVERRIDES = ["model.n_layers=2", "data.seq_len=32", "train.steps=3", "train.log_every=3",
             "train.eval_every=0", "logging.tensorboard=false"]

READER = textwrap.dedent("""
    import sys
    import numpy as np
    import orbax.checkpoint as ocp
    tree = ocp.StandardCheckpointer().restore(sys.argv[1])
    assert "zjax" not in sys.modules
    import jax
    assert len(jax.devices()) == 1
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    arrays = {jax.tree_util.keystr(p, simple=True, separator="/"): np.asarray(x)
              for p, x in flat}
    assert all(isinstance(x, np.ndarray) for _, x in flat)
    np.savez(sys.argv[2], **{k: a.view(np.uint16) if a.dtype.name == "bfloat16" else a
                             for k, a in arrays.items()})
""")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    cfg = load_config(ROOT / "configs/tiny.yaml", OVERRIDES)
    result = zjax.train("lm", cfg, run_dir=run_dir)
    master = jax.tree.map(np.asarray, result.state.params)  # stage 3: float32 master
    return run_dir, cfg, master


def _read_outside_zjax(path: Path, tmp_path: Path) -> dict:
    npz = tmp_path / "read.npz"
    # subprocess: a process that never imported zjax, with jax's one default device
    r = subprocess.run([sys.executable, "-c", READER, str(path), str(npz)],
                       env=cli_env(JAX_PLATFORMS="cpu"),
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    return dict(np.load(npz))


def _logits(cfg, params) -> np.ndarray:
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: GPT(cfg.model, rngs=nnx.Rngs(0))))
    tokens = jnp.asarray(np.arange(2 * 32).reshape(2, 32) % 256, jnp.int32)
    with jax.default_device(jax.devices()[0]):
        return np.asarray(nnx.merge(graphdef, params)(tokens))


def _as_tree(flat: dict, like) -> dict:
    paths = jax.tree_util.tree_flatten_with_path(like)[0]
    leaves = [flat[jax.tree_util.keystr(p, simple=True, separator="/")] for p, _ in paths]
    return jax.tree.unflatten(jax.tree.structure(like), leaves)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_orbax_export_restores_without_zjax(run, tmp_path, dtype):
    run_dir, cfg, master = run
    out = export(run_dir, tmp_path / "export", dtype=dtype)
    flat = _read_outside_zjax(out, tmp_path)
    if dtype == "bfloat16":
        flat = {k: v.view(ml_dtypes.bfloat16) for k, v in flat.items()}
    params = _as_tree(flat, master)
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(master), strict=True):
        np.testing.assert_array_equal(got, want.astype(dtype))  # exactly the cast master
    ref = _logits(cfg, master)
    got = _logits(cfg, jax.tree.map(lambda x: x.astype(np.float32), params))
    tol = 0 if dtype == "float32" else 0.05 * np.abs(ref).max()
    np.testing.assert_allclose(got, ref, atol=tol, rtol=0)
    assert np.isfinite(ref).all()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_safetensors_export_streams_every_leaf(run, tmp_path, dtype):
    run_dir, _, master = run
    out = export(run_dir, tmp_path / "model.safetensors", dtype=dtype, format="safetensors")
    raw = out.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    flat = jax.tree_util.tree_flatten_with_path(master)[0]
    assert len(header) == len(flat)
    for path, want in flat:
        name = jax.tree_util.keystr(path, simple=True, separator=".")
        meta = header[name]
        start, end = meta["data_offsets"]
        np_dtype = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
        assert meta["dtype"] == {"float32": "F32", "bfloat16": "BF16"}[dtype]
        got = np.frombuffer(data[start:end], np_dtype).reshape(meta["shape"])
        np.testing.assert_array_equal(got, want.astype(np_dtype))


def test_export_refuses_bad_input(run, tmp_path):
    run_dir, _, _ = run
    with pytest.raises(zjax.CheckpointError, match="holds no checkpoint"):
        export(tmp_path, tmp_path / "x")
    (tmp_path / "taken").mkdir()
    with pytest.raises(zjax.CheckpointError, match="already exists"):
        export(run_dir, tmp_path / "taken")
    with pytest.raises(zjax.ConfigError, match="--dtype: unknown dtype 'int8'"):
        export(run_dir, tmp_path / "y", dtype="int8")
    r = zjax_main("export", str(tmp_path / "nope"), str(tmp_path / "z"))
    assert r.returncode == 2 and "holds no checkpoint" in r.stderr and "Traceback" not in r.stderr
