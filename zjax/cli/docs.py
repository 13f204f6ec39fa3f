"""``python -m zjax.cli.docs [--write README.md]``: print (or rewrite in place) the config
reference."""

import sys
from pathlib import Path

from zjax.cli._docs import BEGIN, END, config_reference

if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--write":
        path = Path(sys.argv[2])
        text = path.read_text()
        start, end = text.index(BEGIN), text.index(END) + len(END)
        path.write_text(text[:start] + config_reference() + text[end:])
    else:
        print(config_reference())
