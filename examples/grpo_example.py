"""The GRPO example's data, made here (nothing downloaded):

    python examples/grpo_example.py data/grpo

writes ``data/grpo/prompts.jsonl`` (Hugging Face TRL's prompt layout: a ``prompt`` string
and an ``answer`` column, which the reward function receives) and a word-level tokenizer
of 14 tokens beside it (``tokenizer.json``, ``tokenizer_config.json``: the digits, ``+``,
``=``, padding and the end-of-sequence token ``</s>`` that ends a completion). Each prompt is
a sum of two digits from 0 to 4 (``3+4=``), each sum from 0 to 8 equally often; its
answer the sum. ``configs/grpo-tiny.yaml``
trains a small Llama from scratch with GRPO on them: the reward (``zjax.rl:exact_answer``)
is 1 where the completion's last number is the sum, and nothing else tells the model what
a sum is.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

TOKENS = ["<pad>", "</s>", *"0123456789", "+", "="]


def write_tokenizer(out: Path) -> Path:
    """A word-level tokenizer of :data:`TOKENS`, one token per character, ``</s>`` its
    end-of-sequence token."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({t: i for i, t in enumerate(TOKENS)},
                                           unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("</s>|."), "isolated")
    tokenizer.decoder = decoders.Fuse()  # "1" "2" -> "12", as written
    tokenizer.add_special_tokens(["<pad>", "</s>"])
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "</s>", "pad_token": "<pad>"}))
    return out / "tokenizer.json"


def write_prompts(path: Path, n: int, *, seed: int = 0) -> Path:
    """``n`` prompts (``a+b=`` with their ``answer``) as JSON lines at ``path``."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        # each sum equally often (else 8 = 4+4 is one prompt in 25, and a policy that
        # never answers 8 loses little reward: rare answers are the ones GRPO gives up on)
        total = rng.randint(0, 8)
        a = rng.randint(max(0, total - 4), min(4, total))
        rows.append({"prompt": f"{a}+{total - a}=", "answer": str(total)})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="directory to write the prompts and tokenizer")
    parser.add_argument("--prompts", type=int, default=2000)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(args.out)
    write_prompts(args.out / "prompts.jsonl", args.prompts)
    print(f"wrote {args.prompts} prompts and a {len(TOKENS)}-token tokenizer to {args.out}")


if __name__ == "__main__":
    main()
