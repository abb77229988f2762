"""``python -m bench.gpu``: see ``bench.gpu.cli``."""

import sys

from bench.gpu.cli import main

sys.exit(main())
