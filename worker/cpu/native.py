"""The worker's small C libraries (``worker/attention/csrc/``, ``worker/models/csrc/``): compiled
by ``make install`` next to their sources, loaded with ctypes.

NOTE: a library that is missing, stale (another ABI than its wrapper calls) or does not
load (no compiler, another platform) is not an error: ``load`` logs it once at debug
level and returns None, and the caller keeps its torch path.
"""

from __future__ import annotations

import ctypes
import logging
import subprocess
import sys
from pathlib import Path

log = logging.getLogger(__name__)


def build(source: Path, cflags: list[str], cc: str = "gcc") -> Path:
    """Compile ``source`` into the library beside it (raises CalledProcessError on failure)."""
    library = source.with_suffix(".so")
    subprocess.run([cc, *cflags, "-o", str(library), str(source)], check=True)
    return library


def load(path: Path, abi_symbol: str, abi: int, fallback: str, available_symbol: str | None = None) -> ctypes.CDLL | None:
    """The library at ``path`` when its ``abi_symbol()`` returns ``abi`` (and, with
    ``available_symbol``, that function returns 1: the CPU has the instructions it was
    built for); else None, logged with ``fallback`` (what runs instead)."""
    if not path.exists():
        log.debug("%s not built (make install builds it); %s", path, fallback)
        return None
    try:
        lib = ctypes.CDLL(str(path))
        found = getattr(lib, abi_symbol)()
        if found != abi:
            log.debug("%s is stale (ABI %s, want %s; rebuild with make kernels); %s", path, found, abi, fallback)
            return None
        runs = available_symbol is None or getattr(lib, available_symbol)() == 1
    except (OSError, AttributeError) as e:
        log.debug("%s does not load (%s); %s", path, e, fallback)
        return None
    if not runs:
        log.debug("%s needs instructions this CPU lacks; %s", path, fallback)
        return None
    return lib


def build_main(source: Path, cflags: list[str], instead: str) -> None:
    """``python -m`` of a wrapper: build its library (argv[1]: the compiler, gcc if none).
    NOTE: a failure is reported, not fatal: ``instead`` runs without the library."""
    try:
        print(build(source, cflags, *sys.argv[1:2]))
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"{source.name} not built ({e}); {instead}", file=sys.stderr)
