"""Hugging Face weights in and out (PyTorch-layout safetensors, as on the Hub):
``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM`` and
``Phi3ForCausalLM`` (``loop: llama``), ``GPT2LMHeadModel`` (``loop: lm`` with
``model.norm: layer``, ``model.bias: true``).

- :func:`import_hf`: a Hugging Face directory -> a directory to train from
  (``zjax import-hf``); ``train.init_from`` also reads a Hugging Face directory directly.
- ``zjax export RUN_DIR OUT --format hf`` (:func:`zjax.export.export`): a run -> a directory
  ``transformers`` loads; ``--format peft``: a LoRA run's adapters -> a directory PEFT loads
  over the base (:func:`peft_writer`).
- :class:`HFCheckpoint`: the config and tensors of a Hugging Face directory, checked against
  each other, read leaf by leaf or straight into shards.
- :func:`layout_for_hf` / :func:`layout_for_model`: an architecture's :class:`Layout` (its
  ``config.json`` <-> ``model`` section mapping and tensor rules; a key left out is
  transformers' class default, :mod:`zjax.hf._defaults`).
- :func:`model_tokenizer` / :func:`stop_ids`: a model's ``tokenizer.json`` (a slow tokenizer
  alone is refused) and the ids its generation stops at.

The name and layout rules are in :mod:`zjax.hf._llama` (with :mod:`zjax.hf._families`) and
:mod:`zjax.hf._gpt2`. It imports
the models (their config sections), the data package (tokenizers), the checkpoint package
(leaf reader and writer) and the config; export, the training run and the CLI import it.
"""

from zjax.hf._export import DEFAULT_SHARD_BYTES, hf_writer
from zjax.hf._import import import_hf, initial_params
from zjax.hf._layout import Layout, Leaf
from zjax.hf._layouts import layout_for_hf, layout_for_model
from zjax.hf._load import HFCheckpoint, is_hf_dir
from zjax.hf._peft import PEFT_PREFIX, peft_writer
from zjax.hf._peft_read import read_peft
from zjax.hf._safetensors import SafetensorsDir, write_safetensors
from zjax.hf._tokenizer import model_tokenizer, stop_ids

__all__ = ["DEFAULT_SHARD_BYTES", "PEFT_PREFIX", "HFCheckpoint", "Layout", "Leaf",
           "SafetensorsDir", "hf_writer", "import_hf", "initial_params", "is_hf_dir",
           "layout_for_hf", "layout_for_model", "model_tokenizer", "peft_writer", "read_peft",
           "stop_ids", "write_safetensors"]
