"""Hugging Face weights in and out (PyTorch-layout safetensors, as on the Hub):
``LlamaForCausalLM`` (``loop: llama``) and ``GPT2LMHeadModel`` (``loop: lm`` with
``model.norm: layer``, ``model.bias: true``).

- :func:`import_hf`: a Hugging Face directory -> a directory to train from
  (``zjax import-hf``); ``train.init_from`` also reads a Hugging Face directory directly.
- ``zjax export RUN_DIR OUT --format hf`` (:func:`zjax.export.export`): a run -> a directory
  ``transformers`` loads.
- :class:`HFCheckpoint`: the config and tensors of a Hugging Face directory, checked against
  each other, read leaf by leaf or straight into shards.
- :func:`layout_for_hf` / :func:`layout_for_model`: an architecture's :class:`Layout` (its
  ``config.json`` <-> ``model`` section mapping and tensor rules).

The name and layout rules are in :mod:`zjax.hf._llama` and :mod:`zjax.hf._gpt2`.
"""

from zjax.hf._import import import_hf, initial_params
from zjax.hf._layout import Layout, Leaf
from zjax.hf._layouts import layout_for_hf, layout_for_model
from zjax.hf._load import HFCheckpoint, is_hf_dir
from zjax.hf._safetensors import SafetensorsDir, write_safetensors

__all__ = ["HFCheckpoint", "Layout", "Leaf", "SafetensorsDir", "import_hf", "initial_params",
           "is_hf_dir", "layout_for_hf", "layout_for_model", "write_safetensors"]
