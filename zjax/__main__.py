"""``python -m zjax`` runs the command line."""

import sys

from zjax.cli import main

sys.exit(main())
