"""The repository's layout and its process boundary.

``scheduler/`` and ``protocol/`` never import torch or ``worker``: the scheduler
process must start, and the wire protocol must load, on a machine without torch.
Checked twice: statically (every import statement, even inside functions) and by
importing every module in a fresh interpreter.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TORCH_FREE = ("scheduler", "protocol")
FORBIDDEN = ("torch", "worker")

REQUIRED = [
    "pyproject.toml",
    "Makefile",
    "README.md",
    "scheduler",
    "worker",
    "protocol",
    "deploy",
    "tests",
    "loadgen",
    ".ci/run",
    "docs/architecture.md",
]


@pytest.mark.parametrize("path", REQUIRED)
def test_required_layout_exists(path):
    assert (REPO / path).exists(), f"{path} is missing from the repository root"


def _forbidden_imports(source: str, filename: str) -> list[str]:
    """(line: statement) for every import of a forbidden top-level package."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module:
                names = [node.module]
            elif node.level >= 2:
                # `from .. import worker` / `from ..worker import x` out of a top-level package.
                names = [node.module] if node.module else [alias.name for alias in node.names]
        elif (
            isinstance(node, ast.Call)
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and (
                (isinstance(node.func, ast.Name) and node.func.id == "__import__")
                or (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
            )
        ):
            names = [node.args[0].value]
        for name in names:
            if name.split(".")[0] in FORBIDDEN:
                found.append(f"{filename}:{node.lineno}: {ast.unparse(node)}")
    return found


def _py_files() -> list[Path]:
    return sorted(p for pkg in TORCH_FREE for p in (REPO / pkg).rglob("*.py"))


def test_static_scan_finds_no_torch_or_worker_imports():
    files = _py_files()
    assert any(p.parent.name == "scheduler" for p in files) and any(p.parent.name == "protocol" for p in files)
    bad = []
    for path in files:
        bad += _forbidden_imports(path.read_text(encoding="utf-8"), str(path.relative_to(REPO)))
    assert bad == [], "scheduler/ and protocol/ must not import torch or worker:\n" + "\n".join(bad)


def test_static_scan_catches_what_it_should():
    src = (
        "import os\n"
        "def f():\n"
        "    import torch.nn as nn\n"
        "    from worker.model import M\n"
        "    import importlib; importlib.import_module('torch')\n"
        "from torchvision import x\n"  # a different package: allowed
        "from .. import worker\n"
    )
    bad = _forbidden_imports(src, "x.py")
    assert sorted(int(b.split(":")[1]) for b in bad) == [3, 4, 5, 7]


_CHILD = """
import importlib, pkgutil, sys
failed = []
for pkg_name in %r:
    pkg = importlib.import_module(pkg_name)
    for info in pkgutil.walk_packages(pkg.__path__, pkg_name + "."):
        if info.name.rsplit(".", 1)[-1] == "__main__":
            continue
        importlib.import_module(info.name)
        print(info.name)
leaked = sorted(m for m in sys.modules if m.split(".")[0] in %r)
print("LEAKED:" + " ".join(leaked))
"""


def test_importing_every_module_loads_no_torch_or_worker():
    out = subprocess.run(
        [sys.executable, "-c", _CHILD % (TORCH_FREE, FORBIDDEN)],
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "scheduler.block_pool" in lines and "protocol.codec" in lines
    assert lines[-1] == "LEAKED:", f"imported by scheduler/ or protocol/: {lines[-1].removeprefix('LEAKED:')}"
