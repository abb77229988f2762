"""``python -m simulator`` (``kvpool-simulate``): the offline what-if simulator."""

import sys

from simulator.cli import main

sys.exit(main())
