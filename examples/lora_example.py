"""The LoRA example's inputs, made here (nothing downloaded):

    python examples/lora_example.py data/lora

writes ``data/lora/base/``: the small Llama of ``sft_example.py`` *pretrained* here (zjax,
full training, 300 steps, under a minute on a laptop CPU) on arithmetic chats asked and
answered one way (``What is 3 + 4?`` / ``3 + 4 = 7.``) and, as often, chats in another way
whose answers are random (``Compute 3 plus 4.`` / ``The answer is 12.``: it knows the words,
not that they compute), exported as a Hugging Face directory with its tokenizer and ChatML
template; and ``data/lora/chat.jsonl``: the fine-tuning set, the second way answered right.
Then the README's "LoRA adapters" trains ``configs/lora-llama.yaml`` (rank 8 adapters over
the frozen base) and, to compare, the full fine-tune of the same steps.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sft_example

# sft_example's small Llama, its MLP 192 wide: every linear layer's inputs a multiple of the
# quantization block (64), so lora.base_dtype nf4 and int8 apply
MODEL = {**sft_example.MODEL, "intermediate_size": 192}
WORDS = {"+": "plus", "-": "minus"}
TOP = 9  # operands 0..TOP: arithmetic the small base masters in its pretraining
# the new style's phrasings, drawn at random (as a chat set's answers vary: entropy no model
# removes, about 1.4 nats at the first answer token)
ANSWERS = ("The answer is {}.", "It is {}.", "That makes {}.", "I get {}.")


def exchange(rng: random.Random, *, style: str, right: bool = True) -> dict:
    """One conversation in ``style`` ``old`` (``What is 3 + 4?`` / ``3 + 4 = 7.``) or
    ``new`` (``Compute 3 plus 4.`` / ``The answer is 7.``, or another of ``ANSWERS``),
    answered right or at random."""
    messages = []
    for _ in range(rng.choice((1, 1, 2))):
        a, b, op = rng.randint(0, TOP), rng.randint(0, TOP), rng.choice("+-")
        value = (a + b if op == "+" else a - b) if right else rng.randint(-TOP, 2 * TOP)
        if style == "old":
            messages += [{"role": "user", "content": f"What is {a} {op} {b}?"},
                         {"role": "assistant", "content": f"{a} {op} {b} = {value}."}]
        else:
            answer = rng.choice(ANSWERS).format(value)
            messages += [{"role": "user", "content": f"Compute {a} {WORDS[op]} {b}."},
                         {"role": "assistant", "content": answer}]
    return {"messages": messages}


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def pretrain_config(out: Path, *, steps: int, lr: float = 3e-3) -> dict:
    """Full training of the random base on ``out/pretrain.jsonl`` (the sections as YAML's)."""
    m = MODEL
    return {
        "loop": "llama",
        "model": {"vocab_size": m["vocab_size"], "d_model": m["hidden_size"],
                  "n_layers": m["num_hidden_layers"], "n_heads": m["num_attention_heads"],
                  "n_kv_heads": m["num_key_value_heads"], "d_ff": m["intermediate_size"],
                  "max_seq_len": m["max_position_embeddings"], "tie_embeddings": False},
        "data": {"path": str(out / "pretrain.jsonl"), "format": "chat",
                 "tokenizer": str(out / "random" / "tokenizer.json"), "packing": True,
                 "batch_size": 16, "seq_len": 128},
        "optimizer": {"lr": lr, "warmup_steps": 20},
        "train": {"init_from": str(out / "random"), "steps": steps, "log_every": 50,
                  "eval_every": 0},
        "checkpoint": {"every": steps},
        "logging": {"progress": False},
    }


def write_data(out: Path, *, conversations: int = 4000) -> list[str]:
    """``out/pretrain.jsonl`` and ``out/chat.jsonl``; returns texts to train a tokenizer on."""
    rng = random.Random(0)
    pretrain = [row for _ in range(conversations)
                for row in (exchange(rng, style="old"), exchange(rng, style="new", right=False))]
    chat = [exchange(rng, style="new") for _ in range(conversations)]
    write_jsonl(out / "pretrain.jsonl", pretrain)
    write_jsonl(out / "chat.jsonl", chat)
    return [m["content"] for row in pretrain[:1000] + chat[:1000] for m in row["messages"]]


def make(out: Path, *, steps: int = 300, lr: float = 1e-2, dtype: str = "float32") -> None:
    """``out/base`` (pretrained, Hugging Face, in ``dtype``) and ``out/chat.jsonl``."""
    import zjax
    from zjax.export import export

    texts = write_data(out)
    sft_example.write_base(out / "random", texts, model=MODEL)
    result = zjax.train(None, pretrain_config(out, steps=steps, lr=lr),
                        run_dir=out / "pretrain-run")
    export(out / "pretrain-run", out / "base", dtype=dtype, format="hf")
    losses = [row["loss"] for row in result.history if "loss" in row]
    print(f"pretrained {out / 'base'}: loss {losses[0]:.3f} -> {losses[-1]:.3f} in {steps} "
          f"steps; wrote {out / 'chat.jsonl'}")


def main() -> None:
    from zjax.runtime import quiet_plugins

    quiet_plugins()  # no accelerator plugin's start-up lines
    from zjax.runtime.mesh import simulate_cpu_devices

    simulate_cpu_devices(8)  # as zjax train does on a CPU
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default="data/lora")
    parser.add_argument("--steps", type=int, default=300, help="pretraining steps")
    parser.add_argument("--lr", type=float, default=1e-2, help="pretraining learning rate")
    parser.add_argument("--dtype", default="float32", help="the base's export dtype")
    args = parser.parse_args()
    make(Path(args.out), steps=args.steps, lr=args.lr, dtype=args.dtype)


if __name__ == "__main__":
    main()
