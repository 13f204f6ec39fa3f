"""The CLI's tools: ``zjax tokenize``, ``zjax import-hf``, ``zjax sample`` and ``zjax config
from-deepspeed`` (and the DeepSpeed config under ``zjax train --deepspeed``). Separate from
:mod:`zjax.cli` to keep it small."""

from __future__ import annotations

import argparse
import math
import os
import re
import sys

from zjax.errors import ConfigError

__all__ = ["config_from_deepspeed", "parse_size", "run_tool", "tokenize", "tool_parsers",
           "with_deepspeed"]


_SIZE = re.compile(r"\s*([+-]?(?:\d+\.?\d*|\.\d+)(?:e[+-]?\d+)?)\s*([kmg]i?b|b)?\s*",
                   re.IGNORECASE)
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10,
               "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """``5GB``, ``500MB``, ``2GiB``, ``1.5GB``, ``500B`` or a byte count (``500``, ``1e3``),
    rounded down to whole bytes; a count of bytes itself must be whole."""
    m = _SIZE.fullmatch(text)
    if not m:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size (e.g. 5GB, 500MB, 2GiB, or bytes: 500B, 500)")
    unit = (m.group(2) or "").upper()
    value = float(m.group(1)) * _SIZE_UNITS[unit]
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite size")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    if _SIZE_UNITS[unit] == 1 and value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of bytes")
    return int(value)


def tool_parsers(sub) -> None:
    """The subcommands ``tokenize``, ``import-hf`` and ``sample``."""
    tk = sub.add_parser("tokenize", help="records or text files to token ids, document "
                        "boundaries and loss masks (a directory), or text to one .npy stream "
                        "(data.path)")
    tk.add_argument("inputs", nargs="+", help="record files (.jsonl[.gz|.zst], .parquet, "
                    ".arrow, datasets directories) or text files, directories or globs")
    tk.add_argument("-o", "--output", required=True, help="a new directory (documents and "
                    "loss masks), or a .npy (one token stream: of text files, or of --format "
                    "text records)")
    tk.add_argument("--tokenizer", required=True, help="a Hugging Face tokenizer.json")
    from zjax.data.config import FORMATS

    tk.add_argument("--format", default="text", choices=FORMATS, help="as data.format")
    tk.add_argument("--text-field", default="text", help="as data.text_field")
    tk.add_argument("--messages-field", default="messages", help="as data.messages_field")
    tk.add_argument("--train-on-prompt", action="store_true", help="as data.train_on_prompt")
    tk.add_argument("--eos-token", default=None, help="as data.eos_token: the token ending "
                    "each text record or completion (default: tokenizer_config.json's "
                    "eos_token; '' for none)")
    tk.add_argument("--seq-len", type=int, default=None, help="as data.seq_len: --format "
                    "preference cuts each sequence to seq_len + 1 tokens as it is tokenized "
                    "(training then needs the same data.seq_len; default 128)")
    tk.add_argument("--max-prompt-len", type=int, default=None, help="as "
                    "data.max_prompt_len (--format preference; default seq_len // 2)")
    tk.add_argument("--workers", type=int, default=0, help="encoding processes (default: one "
                    "per core; 1 encodes in this process)")
    im = sub.add_parser("import-hf", help="a Hugging Face model (Llama, Mistral, Qwen2, "
                        "Qwen3, Phi-3, Gemma 1-3, GPT-2: config.json, safetensors) as a "
                        "directory to train from (OUT/zjax.yaml)")
    im.add_argument("hf_dir", help="config.json and *.safetensors (PyTorch layout, the Hub's)")
    im.add_argument("out", help="a new directory")
    im.add_argument("--dtype", default="float32", help="stored dtype: float32 or bfloat16")
    sa = sub.add_parser("sample", help="generate text from a run's newest checkpoint, an "
                        "import-hf directory or a Hugging Face Llama (KV cache)")
    sa.add_argument("source", help="RUN_DIR, an import-hf OUT, or a Hugging Face directory")
    said = sa.add_mutually_exclusive_group(required=True)
    said.add_argument("--prompt", help="the text to continue")
    said.add_argument("--chat", help="a user turn: rendered with the tokenizer's chat "
                      "template and its generation prompt; the reply is printed")
    sa.add_argument("--max-new-tokens", type=int, default=100, help="tokens to generate")
    sa.add_argument("--temperature", type=float, default=0.8, help="0 for greedy")
    sa.add_argument("--top-p", type=float, default=0.95, help="nucleus mass in (0, 1]")
    sa.add_argument("--seed", type=int, default=0,
                    help="RNG seed of the draws, in [0, 2**32)")
    sa.add_argument("-n", "--num-samples", type=int, default=1, help="continuations")
    sa.add_argument("--adapter", default=None, help="a PEFT LoRA adapter directory "
                    "(adapter_config.json, adapter_model.safetensors) applied over the model")


def run_tool(args) -> int:
    """Run the tool subcommand ``args.command``.

    ``tokenize`` and ``import-hf`` stop on SIGINT or SIGTERM with their partial output
    removed and their worker processes ended, and exit 128 + the signal's number
    (:mod:`zjax.runtime.stop`)."""
    if args.command == "sample":
        return sample(args)
    from zjax.runtime import write_stderr
    from zjax.runtime.stop import Stopped, stoppable

    try:
        with stoppable():
            return tokenize(args) if args.command == "tokenize" else _import_hf(args)
    except Stopped as e:
        sys.stdout.flush()
        write_stderr(f"zjax: {args.command} {e}; nothing was written\n")
        return 128 + e.signum


def _import_hf(args) -> int:
    from zjax.hf import import_hf

    out = import_hf(args.hf_dir, args.out, dtype=args.dtype)
    print(f"zjax import-hf: {args.hf_dir} -> {out}; train with: zjax train "
          f"{out / 'zjax.yaml'}")
    return 0


def sample(args) -> int:
    """``zjax sample``: print the prompt and each continuation."""
    finite = math.isfinite
    checks = [("--max-new-tokens", args.max_new_tokens >= 1, "an integer >= 1"),
              ("--temperature", finite(args.temperature) and args.temperature >= 0,
               "a finite number >= 0 (0: greedy)"),
              ("--top-p", finite(args.top_p) and 0 < args.top_p <= 1, "a number in (0, 1]"),
              ("--num-samples", args.num_samples >= 1, "an integer >= 1")]
    for flag, ok, expected in checks:
        if not ok:
            value = getattr(args, flag[2:].replace("-", "_"))
            raise ConfigError(f"{flag}: {value!r}; expected {expected}")
    from zjax.export.sample import check_seed, load_sampler, utf8

    check_seed(args.seed)
    utf8(args.prompt if args.chat is None else args.chat)  # before the model loads
    sampler = load_sampler(args.source, adapter=args.adapter)
    how = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
               top_p=args.top_p, seed=args.seed, n=args.num_samples)
    texts = (sampler(args.prompt, **how) if args.chat is None
             else sampler.chat(args.chat, **how))
    for i, text in enumerate(texts):
        if len(texts) > 1:
            print(f"--- sample {i + 1}")
        print(text if args.chat is not None else args.prompt + text)
    return 0


def with_deepspeed(ds_path: str, path: str | None, overrides: list[str], n_devices: int):
    """``path`` + ``overrides`` with a DeepSpeed config's keys beneath the overrides, and a
    line for each DeepSpeed key ignored (with its reason)."""
    from zjax.config import from_deepspeed, load_config, read_deepspeed

    mesh = load_config(path, overrides).mesh
    ds_dict = read_deepspeed(ds_path)
    n_data = mesh.data if mesh.model == -1 else n_devices // mesh.model
    if mesh.model != -1 and "sequence_parallel_size" not in ds_dict:
        n_data //= mesh.context  # the config's own context axis: DeepSpeed's ranks are over it
    ds = from_deepspeed(ds_dict, n_data=n_data)
    return load_config(path, [*ds.overrides, *overrides]), [
        f"deepspeed {key}: ignored: {why}" for key, why in ds.ignored]


def config_from_deepspeed(ds_path: str, path: str | None, overrides: list[str], *,
                          devices: int, output: str | None) -> int:
    """``zjax config from-deepspeed``: the resolved config as YAML (stdout or ``output``)."""
    from pathlib import Path

    import yaml

    config, ignored = with_deepspeed(ds_path, path, overrides, devices)
    for line in ignored:  # stdout is the YAML
        print(line, file=sys.stderr)
    text = yaml.safe_dump(config.to_dict(), sort_keys=False)
    if output is None:
        print(text, end="")
        return 0
    from zjax.training import atomic_write

    if Path(output).exists():
        raise ConfigError(f"-o: {output!r} already exists; zjax does not replace it")
    atomic_write(Path(output), text)
    return 0


def tokenize(args) -> int:
    """``zjax tokenize``: records (or text files) into a directory of documents, or text
    files into one memory-mappable ``.npy`` stream."""
    from zjax.data import DataConfig
    from zjax.data.tokenize import tokenize_records

    stream = str(args.output).lower().endswith(".npy")
    if args.workers < 0:
        raise ConfigError(f"--workers: {args.workers}; expected an integer >= 0 (0: one per "
                          "core)")
    bar = None
    if sys.stderr.isatty():
        from rich.progress import Progress

        bar = Progress(transient=True)
        task = bar.add_task("tokenize")
        bar.start()
    advance = None if bar is None else (lambda n: bar.advance(task, n))
    try:
        cut = {k: v for k, v in (("seq_len", args.seq_len),
                                 ("max_prompt_len", args.max_prompt_len)) if v is not None}
        data = DataConfig(tokenizer=args.tokenizer, format=args.format,
                          text_field=args.text_field, messages_field=args.messages_field,
                          train_on_prompt=args.train_on_prompt, eos_token=args.eos_token,
                          **cut)
        done = tokenize_records(args.inputs, args.output, data=data, progress=advance,
                                workers=args.workers or os.cpu_count() or 1)
    finally:
        if bar is not None:
            bar.stop()
    if stream:
        what = (f"{done['files']} files" if "files" in done
                else f"{done['documents']:,} records")
        print(f"zjax tokenize: {done['tokens']:,} tokens of {what} -> {args.output} "
              f"({done['dtype']}, vocabulary {done['vocab_size']:,}); train with "
              f"data.path={args.output} data.tokenizer={args.tokenizer}")
    else:
        print(f"zjax tokenize: {done['documents']:,} documents, {done['tokens']:,} tokens "
              f"({done['loss_tokens']:,} trained on) -> {args.output}; train with "
              f"data.path={args.output}")
    return 0
