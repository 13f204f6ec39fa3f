"""The preference-tuning example's data, made here (nothing downloaded):

    python examples/dpo_example.py data/dpo

writes ``data/dpo/pairs.jsonl``: preference pairs in Hugging Face TRL's standard layout
(``prompt``, ``chosen``, ``rejected`` strings), read byte by byte (no tokenizer). Each prompt
lists five digits (``sort 5 2 8 1 5:``); the chosen answer lists them in ascending order
(`` 1 2 5 5 8``), the rejected one in an order that is not ascending: a rule the chosen
answer follows and the rejected one breaks. ``configs/dpo-llama.yaml`` trains a small Llama
on them with DPO (a frozen copy of the starting weights as the reference); its eval
``rewards/accuracies`` says how often the tuned model prefers the sorted answer of a pair it
never saw.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

DIGITS = 5


def pair(rng: random.Random) -> dict:
    """One prompt, its sorted answer and a shuffled one that is not sorted."""
    digits = [rng.randint(0, 9) for _ in range(DIGITS)]
    while len(set(digits)) < 2:  # a list of one repeated digit has no unsorted order
        digits = [rng.randint(0, 9) for _ in range(DIGITS)]
    ordered = sorted(digits)
    shuffled = ordered[:]
    while shuffled == ordered:
        rng.shuffle(shuffled)
    say = lambda xs: "".join(f" {d}" for d in xs)
    return {"prompt": f"sort{say(digits)}:", "chosen": say(ordered), "rejected": say(shuffled)}


def write_pairs(path: Path, n: int, *, seed: int = 0) -> Path:
    """``n`` pairs as JSON lines at ``path``."""
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(pair(rng)) + "\n" for _ in range(n)))
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="directory to write pairs.jsonl into")
    parser.add_argument("--pairs", type=int, default=4000)
    args = parser.parse_args(argv)
    path = write_pairs(args.out / "pairs.jsonl", args.pairs)
    print(f"wrote {args.pairs} preference pairs to {path}")


if __name__ == "__main__":
    main()
