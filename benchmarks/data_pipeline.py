"""The fine-tuning data pipeline on this machine, against its ceilings, in one run.

``tokenize``: tokens/s of ``zjax tokenize`` (``tokenize_records``: read, encode, write the
directory; in this process) on JSON lines and on Parquet, in the ``text`` format, against the
``tokenizers`` library's own ``encode_batch`` on the same texts already in memory (the
ceiling: what the tokenizer alone does with every core); and on chat JSON lines (the
template rendered in Python, then the same encoder; in this process and with one worker
process per core) against ``encode_batch`` of the rendered texts. The texts are the standard
library's ``.py`` files, one document per 4 KB; the tokenizer a 4096-token BPE trained on
them here.

``loading``: the data-loading time per step (``next()`` of the loop's iterator: windows read,
packed, batched) against the training step's own time (``step_time_s`` of a short run on 8
simulated CPU devices), for ``configs/tiny.yaml`` and the SFT example
(``configs/sft-llama.yaml`` on ``examples/sft_example.py``'s data, random init).

Medians of ``--repeats`` runs. Prints one JSON object.

Usage: ``python benchmarks/data_pipeline.py tokenize``; ``... loading``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))


def _texts(limit_bytes: int) -> list[str]:
    from zjax.data import stdlib_files

    out, total = [], 0
    for f in stdlib_files():
        text = f.read_text(errors="replace")
        out.extend(text[i:i + 4096] for i in range(0, len(text), 4096))
        total += len(text)
        if total >= limit_bytes:
            break
    return out


def _bpe(directory: Path, texts: list[str]) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts[:2000], trainers.BpeTrainer(
        vocab_size=4096, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return directory / "tokenizer.json"


def _median(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _zjax_rate(paths: list[str], data, tmp: Path, repeats: int,
               workers: int = 1) -> tuple[float, int]:
    from zjax.data import tokenize_records

    made = {}

    def once():
        out = tmp / "out"
        shutil.rmtree(out, ignore_errors=True)
        made.update(tokenize_records(paths, out, data=data, workers=workers))

    seconds = _median(once, repeats)
    return made["tokens"] / seconds, made["tokens"]


def tokenize(repeats: int, megabytes: int) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer

    from zjax.data import DataConfig

    tmp = Path(tempfile.mkdtemp())
    texts = _texts(megabytes << 20)
    tk_path = _bpe(tmp, texts)
    tok = Tokenizer.from_file(str(tk_path))
    (tmp / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    pq.write_table(pa.Table.from_pylist([{"text": t} for t in texts]), tmp / "d.parquet")
    n = sum(len(e.ids) for e in tok.encode_batch(texts))
    ceiling = n / _median(lambda: tok.encode_batch(texts), repeats)
    data = DataConfig(tokenizer=str(tk_path))
    out = {"documents": len(texts), "megabytes": round(sum(map(len, texts)) / 2**20, 1),
           "tokens": n, "ceiling_tokens_per_s": round(ceiling)}
    for name in ("jsonl", "parquet"):
        rate, _ = _zjax_rate([str(tmp / f"d.{name}")], data, tmp, repeats)
        out[f"{name}_tokens_per_s"] = round(rate)
        out[f"{name}_vs_ceiling"] = round(rate / ceiling, 3)
    out.update(_chat(tmp, repeats))
    shutil.rmtree(tmp, ignore_errors=True)
    return out


def _chat(tmp: Path, repeats: int) -> dict:
    """Chat JSON lines through the template and the encoder, against encode_batch alone."""
    import sft_example
    from tokenizers import Tokenizer

    from zjax.data import DataConfig, load_chat_template

    rows = sft_example.conversations(20000)
    (tmp / "chat").mkdir()
    tk_path = sft_example.chat_tokenizer(tmp / "chat", [m["content"] for r in rows[:2000]
                                                        for m in r["messages"]])
    (tmp / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    template = load_chat_template(tk_path)
    rendered = [template.render(r["messages"]) for r in rows]
    tok = Tokenizer.from_file(str(tk_path))
    n = sum(len(e.ids) for e in tok.encode_batch(rendered, add_special_tokens=False))
    ceiling = n / _median(lambda: tok.encode_batch(rendered, add_special_tokens=False),
                          repeats)
    data = DataConfig(tokenizer=str(tk_path), format="chat")
    out = {"chat_conversations": len(rows), "chat_tokens": n,
           "chat_ceiling_tokens_per_s": round(ceiling)}
    for workers in (1, os.cpu_count() or 1):
        rate, _ = _zjax_rate([str(tmp / "c.jsonl")], data, tmp, repeats, workers=workers)
        out[f"chat_tokens_per_s_workers{workers}"] = round(rate)
        out[f"chat_vs_ceiling_workers{workers}"] = round(rate / ceiling, 3)
    return out


def _loading_one(config_path: str, overrides: list[str], repeats: int) -> dict:
    import zjax
    from zjax.task import resolve_loop

    config = zjax.load_config(ROOT / config_path, [
        *overrides, "train.steps=60", "train.log_every=10", "train.eval_every=0",
        "logging.tensorboard=false", "logging.progress=false"])
    loop = resolve_loop(config.loop)
    it = loop.data(config.data, split="train", seed=0)
    next(it)
    per_batch = statistics.median(
        _median(lambda: [next(it) for _ in range(50)], 1) / 50 for _ in range(repeats))
    history = zjax.train(config.loop, config).history
    step = statistics.median(r["step_time_s"] for r in history[1:])
    return {"data_s_per_batch": per_batch, "step_time_s": step,
            "data_share": round(per_batch / step, 4)}


def loading(repeats: int) -> dict:
    from zjax.runtime.mesh import simulate_cpu_devices

    simulate_cpu_devices(8)
    import sft_example

    tmp = Path(tempfile.mkdtemp())
    rows = sft_example.conversations(4000)
    (tmp / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tk = sft_example.chat_tokenizer(tmp, [m["content"] for r in rows[:2000]
                                          for m in r["messages"]])
    sft = [f"data.path={tmp / 'chat.jsonl'}", f"data.tokenizer={tk}", "train.init_from=null"]
    out = {"tiny": _loading_one("configs/tiny.yaml", [], repeats),
           "sft": _loading_one("configs/sft-llama.yaml", sft, repeats)}
    shutil.rmtree(tmp, ignore_errors=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["tokenize", "loading"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--megabytes", type=int, default=16)
    args = parser.parse_args()
    result = tokenize(args.repeats, args.megabytes) if args.what == "tokenize" else loading(
        args.repeats)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
