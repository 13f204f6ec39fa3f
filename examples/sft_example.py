"""The supervised fine-tuning example's inputs, generated here (nothing downloaded):

    python examples/sft_example.py data/sft

writes ``data/sft/base/`` (a small Llama as a Hugging Face directory: ``config.json``,
``model.safetensors`` with random weights, ``tokenizer.json`` and a ``tokenizer_config.json``
whose ChatML ``chat_template`` marks the assistant's turns) and ``data/sft/chat.jsonl``
(arithmetic conversations: ``{"messages": [{"role": ..., "content": ...}, ...]}``). Then the
README's "Fine-tuning on chat data" runs ``zjax import-hf`` -> ``zjax train
configs/sft-llama.yaml`` -> ``zjax export --format hf`` -> ``zjax sample --chat``.

With a real model, point ``import-hf`` at its Hub directory and ``data.path`` at your data.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import numpy as np

SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# ChatML, as Qwen's; the {% generation %} block marks what the loss trains on
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ message['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# the same rendering without the markers (as most shipped templates are)
CHATML_PLAIN = CHATML.replace("{% generation %}", "").replace("{% endgeneration %}", "")
MODEL = dict(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def conversation(rng: random.Random) -> dict:
    """One arithmetic exchange (a system turn now and then, sometimes two rounds)."""
    messages = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": "You are a careful calculator."})
    for _ in range(rng.choice((1, 1, 2))):
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        op = rng.choice("+-")
        value = a + b if op == "+" else a - b
        messages.append({"role": "user", "content": f"What is {a} {op} {b}?"})
        messages.append({"role": "assistant", "content": f"{a} {op} {b} = {value}."})
    return {"messages": messages}


def conversations(n: int, *, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [conversation(rng) for _ in range(n)]


def chat_tokenizer(directory: Path, texts: list[str], *, template: str = CHATML,
                   vocab_size: int = 512) -> Path:
    """A byte-level BPE trained on ``texts`` with ChatML's special tokens, and its
    ``tokenizer_config.json`` (``chat_template``, ``eos_token``). Returns the tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {"chat_template": template, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "bos_token": None, "tokenizer_class": "PreTrainedTokenizerFast"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return directory / "tokenizer.json"


def write_base(directory: Path, tokenizer_texts: list[str], *, seed: int = 0,
               model: dict = MODEL) -> None:
    """A randomly initialised Llama (``model``'s shape) as a Hugging Face directory."""
    MODEL = model
    from zjax.hf import write_safetensors

    chat_tokenizer(directory, tokenizer_texts)
    eos = json.loads((directory / "tokenizer.json").read_text())["model"]["vocab"]["<|im_end|>"]
    config = dict(MODEL, architectures=["LlamaForCausalLM"], model_type="llama",
                  hidden_act="silu", rms_norm_eps=1e-5, rope_theta=10000.0,
                  tie_word_embeddings=False, eos_token_id=eos, torch_dtype="float32")
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    rng = np.random.default_rng(seed)
    d, f, v = MODEL["hidden_size"], MODEL["intermediate_size"], MODEL["vocab_size"]
    kv = d // MODEL["num_attention_heads"] * MODEL["num_key_value_heads"]
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,),
              "lm_head.weight": (v, d)}
    for i in range(MODEL["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (d,),
                       p + "post_attention_layernorm.weight": (d,),
                       p + "self_attn.q_proj.weight": (d, d),
                       p + "self_attn.k_proj.weight": (kv, d),
                       p + "self_attn.v_proj.weight": (kv, d),
                       p + "self_attn.o_proj.weight": (d, d),
                       p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                       p + "mlp.down_proj.weight": (d, f)})
    tensors = {k: (np.ones(s, np.float32) if k.endswith("norm.weight")
                   else rng.normal(0, 0.02, s).astype(np.float32)) for k, s in shapes.items()}
    write_safetensors(directory / "model.safetensors",
                      [(k, a.shape, a.dtype) for k, a in tensors.items()],
                      lambda: iter(tensors.values()))


def main() -> None:
    from zjax.runtime import quiet_plugins

    quiet_plugins()  # no accelerator plugin's start-up lines
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default="data/sft")
    parser.add_argument("--conversations", type=int, default=4000)
    out = Path(parser.parse_args().out)
    rows = conversations(parser.parse_args().conversations)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "chat.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    texts = [m["content"] for row in rows[:2000] for m in row["messages"]]
    write_base(out / "base", texts)
    print(f"wrote {out / 'chat.jsonl'} ({len(rows)} conversations) and {out / 'base'}")


if __name__ == "__main__":
    main()
