"""``python -m scheduler``: the scheduler process (scheduler/engine/main.py)."""

import sys

from scheduler.engine.main import main

sys.exit(main())
