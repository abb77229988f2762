"""deploy/'s replicas-behind-a-router recipe: the systemd units pass `systemd-analyze
verify`, every flag of every kvpool serve and vllm-router command line (units, Kubernetes
manifest) is one their own parsers accept, the ports and ranks line up, and
deploy/run-router.sh runs two real replicas behind the real router end to end."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys

import pytest
import yaml
from kvtest.deploy_config import DEPLOY

from frontend.serve.cli import build_parser

ROOT = DEPLOY.parent
SYSTEMD = DEPLOY / "systemd"
UNITS = ["kvpool-scheduler.service", "kvpool-worker.service", "kvpool-serve.service", "kvpool-serve@.service", "vllm-router.service"]


def exec_start(unit: str) -> str:
    text = (SYSTEMD / unit).read_text()
    line = text.split("\nExecStart=", 1)[1]
    return re.split(r"(?<!\\)\n", line, maxsplit=1)[0].replace("\\\n", " ")


def router_args(argv: list[str]):
    from vllm_router.launch_router import parse_router_args

    return parse_router_args(argv)  # exits 2 on an unknown flag


def serve_args_of_instance(n: int) -> list[str]:
    """The template's command line for instance n, as /bin/sh computes it."""
    cmd = exec_start("kvpool-serve@.service").replace("$$", "$").replace("%i", str(n))
    argv = shlex.split(cmd)
    assert argv[:2] == ["/bin/sh", "-c"] and len(argv) == 3
    script = argv[2].replace("exec /opt/kvpool/.venv/bin/kvpool", 'for a in', 1) + '; do printf "%s\\n" "$a"; done'
    env = {"PATH": os.environ["PATH"], "MODEL": "/opt/kvpool/models/checkpoint"}
    out = subprocess.run(["/bin/sh", "-c", script], capture_output=True, text=True, check=True, timeout=10, env=env).stdout
    return out.splitlines()


@pytest.mark.parametrize("unit", UNITS)
def test_systemd_analyze_verify(unit, tmp_path):
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze not found (Debian: apt-get install systemd)")
    # The units name /opt/kvpool (the install); verify needs the binaries they run to exist.
    name = unit.replace("@.service", "@1.service")
    text = (SYSTEMD / unit).read_text().replace("/opt/kvpool", str(ROOT))
    for other in UNITS:  # units they name (Requires=, After=...) beside them
        (tmp_path / other.replace("@.service", "@1.service")).write_text((SYSTEMD / other).read_text().replace("/opt/kvpool", str(ROOT)))
    (tmp_path / name).write_text(text)
    p = subprocess.run([tool, "verify", str(tmp_path / name)], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    complaints = [line for line in (p.stdout + p.stderr).splitlines() if str(tmp_path) in line or name in line]
    assert p.returncode == 0 and complaints == [], p.stdout + p.stderr


@pytest.mark.parametrize("n", [0, 1, 5])
def test_each_template_instance_gets_its_own_ports_and_rank_0(n):
    a = build_parser().parse_args(serve_args_of_instance(n))  # exits 2 on an unknown flag
    assert a.command == "serve" and a.host == "127.0.0.1"
    # NOTE: no --data-parallel-rank: every instance is an engine of its own, rank 0 (vLLM's meaning).
    assert (a.port, a.worker_http_port) == (8101 + n, 8201 + n) and not hasattr(a, "data_parallel_rank")
    assert a.kv_events_endpoint == f"tcp://127.0.0.1:{5557 + 2 * n}"
    assert a.kv_events_replay_endpoint == f"tcp://127.0.0.1:{5558 + 2 * n}"
    assert a.kv_events_topic == f"kv@127.0.0.1:{8101 + n}@/opt/kvpool/models/checkpoint"


def test_the_router_unit_fronts_the_template_instances():
    argv = shlex.split(exec_start("vllm-router.service"))
    assert argv[0] == "/opt/kvpool/.venv/bin/vllm-router"
    r = router_args(argv[1:])
    assert r.worker_urls == [f"http://127.0.0.1:{8101 + n}" for n in (0, 1)]
    assert (r.policy, r.host, r.port, r.prometheus_port) == ("cache_aware", "127.0.0.1", 8100, 8190)
    text = (SYSTEMD / "vllm-router.service").read_text()
    assert "Wants=kvpool-serve@0.service kvpool-serve@1.service" in text and "Restart=on-failure" in text
    # None of the replicas' ports is the router's.
    taken = {8101, 8102, 8201, 8202, 5557, 5558, 5559, 5560}
    assert {r.port, r.prometheus_port}.isdisjoint(taken)


def test_the_kubernetes_manifest_parses_and_its_flags_exist():
    docs = list(yaml.safe_load_all((DEPLOY / "kubernetes" / "kvpool-router.yaml").read_text()))
    by_kind = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    sts = by_kind[("StatefulSet", "kvpool")]
    assert by_kind[("Service", "kvpool")]["spec"]["clusterIP"] == "None" and sts["spec"]["serviceName"] == "kvpool"
    (serve,) = sts["spec"]["template"]["spec"]["containers"]
    env = {"POD_NAME": "kvpool-1"}
    args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], x) for x in serve["args"]]
    a = build_parser().parse_args(args)
    assert not hasattr(a, "data_parallel_rank") and a.kv_events_topic == "kv@kvpool-1@/models/checkpoint" and a.port == 8000
    assert {e["name"] for e in serve["env"]} == set(env)
    (router,) = by_kind[("Deployment", "vllm-router")]["spec"]["template"]["spec"]["containers"]
    r = router_args(router["args"])
    assert r.worker_urls == [f"http://kvpool-{i}.kvpool:8000" for i in range(sts["spec"]["replicas"])]
    assert r.port == 8100 and by_kind[("Service", "vllm-router")]["spec"]["ports"][0]["port"] == 8100


def test_run_router_sh_syntax():
    subprocess.run(["bash", "-n", str(DEPLOY / "run-router.sh")], check=True, timeout=30)


def _free_base_port() -> int:
    """A port P with P, P+1, P+2 (replicas), P+90 (router metrics) and P+100..P+103 (KV events) free."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base > 65000:
            continue
        ports = [base, base + 1, base + 2, base + 90, *range(base + 100, base + 104)]
        try:
            socks = []
            for p in ports:
                t = socket.socket()
                socks.append(t)
                t.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise RuntimeError("no free block of ports")


@pytest.mark.e2e
@pytest.mark.slow
def test_run_router_sh_serves_a_workload_through_the_router(tmp_path):
    from bench.replicas import router_binary

    if router_binary() is None:
        msg = "vllm-router not found (the test extra installs it)"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    base = _free_base_port()
    env = dict(os.environ, PYTHON=sys.executable, KVPOOL_ROUTER_PORT=str(base), KVPOOL_KV_EVENTS_PORT=str(base + 100),
               KVPOOL_LOG_DIR=str(tmp_path / "logs"), KVPOOL_STOP_TIMEOUT="4", KVPOOL_READY_TIMEOUT="120")
    proc = subprocess.Popen(["bash", str(DEPLOY / "run-router.sh"), "--num-requests", "24"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert proc.returncode == 0, out[-4000:]
    assert f"ready: vllm-router (cache_aware) at http://127.0.0.1:{base}/v1" in out
    served = [int(m) for m in re.findall(r"127\.0\.0\.1:\d+: (\d+) requests, prefix-cache hit rate", out)]
    assert len(served) == 2 and min(served) > 0 and sum(served) == 24, out[-2000:]
    assert re.search(r"aggregate prefix-cache hit rate 0\.\d{3}", out)
    # Nothing left listening.
    for port in (base, base + 1, base + 2):
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0, f"port {port} still served after run-router.sh exited"
