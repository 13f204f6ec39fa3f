"""The command line (``zjax train | plan | export | sample | tokenize | import-hf | config |
launch | plot``): arguments to calls of the packages below, errors as one ``zjax: error:``
line with exit code 2. It reads the process environment (device simulation, the compiler
plugins' start-up) and may import every package; none imports it.
"""

from zjax.cli._main import main

__all__ = ["main"]
