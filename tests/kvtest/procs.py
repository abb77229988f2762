"""The live children of a process, read from /proc: for tests that kill one of the
processes kvpool serve or a rank group started."""

from __future__ import annotations

from pathlib import Path


def children(pid: int) -> dict[int, str]:
    """pid -> command line of the live children of ``pid``."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                out[int(d.name)] = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError, ValueError):
            pass
    return out
