"""Peak host memory (RSS) of ``zjax import-hf`` and ``zjax export --format hf`` against the
model size, by ``export_memory.py``'s method (each in a fresh process, VmHWM above the
interpreter with zjax imported).

Writes a random Llama-family model (``--family llama``, or ``qwen2``: q/k/v biases and tied
embeddings, as Qwen2.5-0.5B has them) of a few hundred MB as a Hugging Face directory
(PyTorch-layout bf16 safetensors, two shards and an index, as the Hub has them; no
transformers needed), imports it, writes a zjax checkpoint of it (a run directory:
``train.init_from`` read into stage-3 shards on 8 simulated CPU devices, no training), and
exports that as Hugging Face safetensors.
Prints one JSON object.

Usage: ``python benchmarks/hf_memory.py [--family qwen2 --d-model 1024 --n-layers 16]``
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
from _peak_rss import peak_rss


def write_hf_dir(directory: Path, args: argparse.Namespace) -> dict:
    """Random bf16 weights under Hugging Face's names, in two files and an index."""
    import ml_dtypes

    from zjax.hf import layout_for_hf
    from zjax.hf._layout import hf_shape
    from zjax.hf._load import model_shapes
    from zjax.hf._safetensors import write_safetensors
    from zjax.models import LlamaConfig

    qwen = args.family == "qwen2"
    cfg = LlamaConfig(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.n_layers,
                      n_heads=16, n_kv_heads=4, d_ff=args.d_ff, max_seq_len=2048,
                      qkv_bias=qwen, tie_embeddings=qwen)
    layout = layout_for_hf({"model_type": args.family}, source="--family")
    leaves, hf_config = layout.leaves, layout.to_hf
    directory.mkdir()
    bf16 = np.dtype(ml_dtypes.bfloat16)
    shapes = model_shapes(cfg)
    tensors = [(name, hf_shape(leaf, shapes[leaf.keys]), bf16)
               for leaf in leaves(cfg) for name in leaf.names(cfg.n_layers)]
    rng = np.random.default_rng(0)
    halves = [tensors[: len(tensors) // 2], tensors[len(tensors) // 2:]]
    weight_map = {}
    for k, part in enumerate(halves):
        file = f"model-{k + 1:05d}-of-00002.safetensors"
        write_safetensors(directory / file, part, lambda part=part: (
            (0.02 * rng.standard_normal(shape, np.float32)).astype(bf16)
            for _, shape, _ in part), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys((n for n, _, _ in part), file))
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(hf_config(cfg, dtype="bfloat16")))
    sizes = [int(np.prod(shapes[leaf.keys])) for leaf in leaves(cfg)]
    return {"params": sum(sizes), "model_bytes_fp32": 4 * sum(sizes),
            "largest_leaf_bytes_fp32": 4 * max(sizes), "hf_bytes_bf16": 2 * sum(sizes)}


def write_run(hf_dir: Path, run_dir: Path) -> None:
    """A run directory whose checkpoint holds the imported weights (stage 3, 8 devices)."""
    from zjax.runtime.mesh import simulate_cpu_devices

    simulate_cpu_devices(8)
    import yaml

    from zjax.checkpoint import CheckpointConfig, Checkpointer
    from zjax.config import load_config
    from zjax.hf import HFCheckpoint, initial_params
    from zjax.task._build import build_step

    model = HFCheckpoint(hf_dir).config
    config = load_config(None, ["loop=llama", "zero.stage=3", "data.seq_len=64",
                                f"train.init_from={hf_dir}",
                                *(f"model.{k}={v}" for k, v in vars(model).items()
                                  if v is not None)])
    zstep = build_step(config)
    state = zstep.from_params(initial_params(hf_dir, zstep.params_target, config.model))
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
    ckpt = Checkpointer(run_dir / "checkpoints", CheckpointConfig())
    ckpt.save(1, state, zstep)
    ckpt.close()


def measure(kind: str, src: Path, out: Path) -> tuple[int, int]:
    call = ('import_hf(sys.argv[2], sys.argv[3], dtype="float32")' if kind == "import" else
            'export(sys.argv[2], sys.argv[3], dtype="bfloat16", format="hf")')
    return peak_rss("from zjax.export import export\nfrom zjax.hf import import_hf", call,
                    [kind, str(src), str(out)])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--family", choices=("llama", "qwen2"), default="llama")
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--n-layers", type=int, default=16)
    p.add_argument("--d-ff", type=int, default=2816)
    p.add_argument("--vocab", type=int, default=32000)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        sizes = write_hf_dir(tmp / "hf", args)
        write_run(tmp / "hf", tmp / "run")
        rows = []
        for kind, src in [("import", tmp / "hf"), ("export", tmp / "run")]:
            baseline, above = measure(kind, src, tmp / f"out-{kind}")
            rows.append({"what": "import-hf (bf16 files -> fp32 params)" if kind == "import"
                         else "export --format hf (bf16)", "baseline_rss_bytes": baseline,
                         "rss_above_baseline_bytes": above,
                         "x_largest_leaf_fp32": round(above / sizes["largest_leaf_bytes_fp32"],
                                                      2),
                         "x_model_fp32": round(above / sizes["model_bytes_fp32"], 2)})
        print(json.dumps({"model": vars(args), **sizes, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
