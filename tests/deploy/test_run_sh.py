"""deploy/run.sh: syntax, and a full launch against stand-in servers (tests/deploy/fake_kvpool.py)
checking the exit status, the report, and that no process is left behind."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kvtest.ports import free_port
from kvtest.real_data import real_model, sharegpt

ROOT = Path(__file__).resolve().parents[2]
RUN_SH = ROOT / "deploy" / "run.sh"
FAKE = Path(__file__).resolve().parent / "fake_kvpool.py"


def test_bash_syntax():
    for script in (RUN_SH, RUN_SH.parent / "processes.sh"):
        subprocess.run(["bash", "-n", str(script)], check=True, timeout=30)


def _free_ports(n: int) -> list[int]:
    return [free_port() for _ in range(n)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); it is dead for our purposes
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _run_sh(run_sh: Path, env: dict[str, str], bound: float, *loadgen_args: str) -> tuple[int, str, str]:
    """``run_sh`` in its own process group, killed whole if it outlives ``bound`` seconds:
    (exit status, stdout, stderr)."""
    proc = subprocess.Popen(["bash", str(run_sh), *loadgen_args], cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=bound)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=10)
    return proc.returncode, out, err


def _launch(tmp_path: Path, extra_env: dict[str, str], *loadgen_args: str, bound: float = 90, clone: Path | None = None):
    """Run run.sh with the stand-in servers. With ``clone``, run a copy of run.sh in that
    folder as a fresh clone after `make install` would: PYTHON unset, the wrapper at
    ``clone/.venv/bin/python``."""
    run_sh = RUN_SH
    wrapper = tmp_path / "python"
    if clone is not None:
        (clone / "deploy").mkdir(parents=True)
        run_sh = clone / "deploy" / "run.sh"
        run_sh.write_text(RUN_SH.read_text())
        (clone / "deploy" / "processes.sh").write_text((RUN_SH.parent / "processes.sh").read_text())
        (clone / ".venv" / "bin").mkdir(parents=True)
        wrapper = clone / ".venv" / "bin" / "python"
    wrapper.write_text(
        "#!/usr/bin/env bash\n"
        'if [ "$1" = "-m" ] && [ "$2" = frontend.serve.cli ]; then\n'
        f'    shift 2; exec "{sys.executable}" "{FAKE}" "$@"\n'
        "fi\n"
        f'exec "{sys.executable}" "$@"\n'
    )
    wrapper.chmod(0o755)
    (http,) = _free_ports(1)
    env = dict(
        {k: v for k, v in os.environ.items() if k != "PYTHON"},
        **({} if clone is not None else {"PYTHON": str(wrapper)}),
        PYTHONPATH=str(ROOT),
        KVPOOL_HTTP_PORT=str(http),
        KVPOOL_MODEL="tiny",  # the synthetic workload (a real model's is test_make_run_serves_the_real_model)
        KVPOOL_LOG_DIR=str(tmp_path / "logs"),
        KVPOOL_READY_TIMEOUT="30",
        KVPOOL_STOP_TIMEOUT="2",
        **extra_env,
    )
    rc, out, err = _run_sh(run_sh, env, bound, *loadgen_args)
    pids = [int(p) for p in re.findall(r"started \w+ \(pid (\d+)\)", err)]
    try:
        deadline = time.monotonic() + 5
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [p for p in pids if _alive(p)]
    finally:
        for p in pids:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
    return rc, out, err, pids, left


@pytest.mark.e2e
def test_run_sh_end_to_end(tmp_path):
    rc, out, err, pids, left = _launch(tmp_path, {}, "--num-requests", "5", "--output-len", "2")
    assert rc == 0, err
    assert "Serving Benchmark Result" in out and "Successful requests:" in out
    assert len(pids) == 1 and not left
    assert (tmp_path / "logs" / "serve.log").read_text().startswith("fake serve up")
    assert "kvpool serve: fake ready at" in err  # the ready line (model, URL, pool) is shown


@pytest.mark.e2e
def test_the_readme_demo_runs_on_a_fresh_clone_without_python_or_out(tmp_path):
    """deploy/README's `bash deploy/run.sh --num-requests 50 --plot out/run.png --result-json
    out/run.json` (fewer requests): no PYTHON, no out/ folder beforehand."""
    clone = tmp_path / "clone"
    rc, out, err, pids, left = _launch(tmp_path, {}, "--num-requests", "5", "--output-len", "2", "--plot", "out/run.png",
                                       "--result-json", "out/run.json", clone=clone)
    assert rc == 0, err
    assert (clone / "out" / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((clone / "out" / "run.json").read_text())["completed"] == 5
    # The report says what ran, and against what.
    assert "Workload: shared-prefix: 5 requests (8 prefixes x 256 tokens + 64-token suffixes, 2 out)" in out
    assert "pool: 8MiB of KV on cpu, block size 16" in err
    assert len(pids) == 1 and not left


@pytest.mark.e2e
def test_run_sh_kills_a_stubborn_server_and_passes_loadgen_status(tmp_path):
    # a bad loadgen flag: loadgen exits 2, run.sh must return 2 and still stop both servers
    rc, out, err, pids, left = _launch(tmp_path, {"FAKE_IGNORE_TERM": "serve"}, "--no-such-flag")
    assert rc == 2
    assert "SIGKILL" in err and "last lines of" in err
    assert len(pids) == 1 and not left


@pytest.mark.e2e
def test_run_sh_fails_fast_when_a_server_dies(tmp_path):
    rc, out, err, pids, left = _launch(tmp_path, {"KVPOOL_SERVE_ARGS": "--port notanumber"})
    assert rc == 1
    assert "serve exited during start-up" in err and "last lines of" in err
    assert not left


@pytest.mark.e2e
@pytest.mark.slow
def test_run_sh_for_real_through_kvpool_serve(tmp_path, tiny_checkpoint):
    """What `make run` does, on a small workload: the real kvpool serve of the tiny
    checkpoint, the HTTP load generator, the report, everything stopped."""
    (http,) = _free_ports(1)
    env = dict(os.environ, PYTHON=sys.executable, KVPOOL_HTTP_PORT=str(http), KVPOOL_MODEL="tiny",
               KVPOOL_LOG_DIR=str(tmp_path / "logs"), KVPOOL_STOP_TIMEOUT="10")
    rc, out, err = _run_sh(RUN_SH, env, 240, "--num-requests", "8", "--prefix-len", "32", "--suffix-len", "8", "--output-len", "4")
    assert rc == 0, err[-3000:]
    assert "Successful requests:" in out and f"via http://127.0.0.1:{http}/v1/completions" in out
    assert f"{tiny_checkpoint} ready at http://127.0.0.1:{http}/v1 (KV cache: 256 blocks × 16 tokens, 8.0 MiB)" in err
    for name in ("scheduler", "worker", "frontend"):
        assert (tmp_path / "logs" / f"{name}.log").exists()
    # nothing left: the API port is free again and no process still serves it
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is fine; a listener is not
        s.bind(("127.0.0.1", http))
        s.listen()
    assert not any(f"--port {http} " in p.read_bytes().replace(b"\0", b" ").decode(errors="replace")
                   for p in Path("/proc").glob("[0-9]*/cmdline") if p.exists())


@pytest.mark.e2e
@pytest.mark.slow
def test_make_run_serves_the_real_model_answers_in_words_then_runs_sharegpt_chats(tmp_path):
    """`make run`'s default, for real: SmolLM2-135M-Instruct's GGUF, one chat answer, then
    ShareGPT's first turns through the chat template (fewer of them)."""
    real_model(), sharegpt()  # installed (skip without them, fail under CI)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "KVPOOL_MODEL")}
    env.update(PYTHON=sys.executable, KVPOOL_HTTP_PORT=str(free_port()), KVPOOL_LOG_DIR=str(tmp_path / "logs"), KVPOOL_STOP_TIMEOUT="4",
               KVPOOL_READY_TIMEOUT="180")
    rc, out, err = _run_sh(RUN_SH, env, 280, "--num-requests", "4", "--sharegpt-output-len", "8")
    assert rc == 0, err[-3000:]
    assert "Q: Name the capital of France." in out and "Paris" in out.split("Q: Name the capital of France.")[1].split("\n\n")[0]
    assert "Workload: sharegpt: 4 requests (ShareGPT_V3_unfiltered_cleaned_split.json, first turns, 8 out)" in out
    assert "Successful requests:" in out and "SmolLM2-135M-Instruct" in err
