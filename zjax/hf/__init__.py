"""Hugging Face Llama weights in and out (PyTorch-layout safetensors, as on the Hub).

- :func:`import_hf`: a Hugging Face directory -> a directory to train from
  (``zjax import-hf``); ``train.init_from`` also reads a Hugging Face directory directly.
- ``zjax export RUN_DIR OUT --format hf`` (:func:`zjax.export.export`): a run -> a directory
  ``transformers`` loads.
- :class:`HFCheckpoint`: the config and tensors of a Hugging Face directory, checked against
  each other, read leaf by leaf or straight into shards.
- :func:`llama_config` / :func:`hf_config`: ``config.json`` <-> zjax's ``model`` section.

The name and layout rules are in :mod:`zjax.hf._llama`.
"""

from zjax.hf._import import import_hf, initial_params
from zjax.hf._llama import hf_config, llama_config
from zjax.hf._load import HFCheckpoint, is_hf_dir
from zjax.hf._safetensors import SafetensorsDir, write_safetensors

__all__ = ["HFCheckpoint", "SafetensorsDir", "hf_config", "import_hf", "initial_params",
           "is_hf_dir", "llama_config", "write_safetensors"]
