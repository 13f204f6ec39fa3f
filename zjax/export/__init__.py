"""What a run gives out: ``zjax export`` (the newest intact checkpoint's params gathered leaf by
leaf into an Orbax tree or Hugging Face safetensors, the checkpoint pinned by hard links while
it is read) and ``zjax sample`` (generation from a run, an import or a Hugging Face directory).

It imports the checkpoint, hf, models, data (tokenizers) and config packages; never the
training run or the command line.
"""

from zjax.export._export import FORMATS, export, newest_intact, read_params
from zjax.export.sample import Sampler, generate, load_sampler

__all__ = ["FORMATS", "Sampler", "export", "generate", "load_sampler", "newest_intact",
           "read_params"]
