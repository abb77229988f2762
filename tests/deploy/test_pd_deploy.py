"""deploy/'s prefill/decode recipe: the Kubernetes manifest's command lines are ones kvpool's
and vllm-router's own parsers accept, with a producer and a consumer config and the router
in PD mode over the two Services; deploy/run-pd.sh's command lines (--dry-run) likewise,
each engine pinned to its core; and run-pd.sh end to end against stand-in engines
(tests/deploy/fake_kvpool.py) behind the real router: the report, the exit status, nothing
left running. The real engines through run-pd.sh are the lead's live run."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from kvtest.deploy_config import DEPLOY
from kvtest.ports import free_port
from kvtest.router import require_router

from frontend.serve.cli import build_parser
from protocol.kv_transfer_config import parse_kv_transfer_config

ROOT = DEPLOY.parent
RUN_PD = DEPLOY / "run-pd.sh"
MANIFEST = DEPLOY / "kubernetes" / "kvpool-pd.yaml"
FAKE = Path(__file__).resolve().parent / "fake_kvpool.py"


def router_args(argv: list[str]):
    from vllm_router.launch_router import parse_router_args

    return parse_router_args(argv)  # exits 2 on an unknown flag


def manifest() -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(MANIFEST.read_text())}


def only_container(deployment: dict) -> dict:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


@pytest.mark.parametrize(("name", "role"), [("kvpool-prefill", "kv_producer"), ("kvpool-decode", "kv_consumer")])
def test_each_engine_deployment_serves_its_role_behind_its_service(name, role, monkeypatch):
    docs = manifest()
    deployment, service = docs[("Deployment", name)], docs[("Service", name)]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"] == labels and service["spec"]["selector"] == labels
    serve = only_container(deployment)
    a = build_parser().parse_args(serve["args"])  # exits 2 on an unknown flag
    assert (serve["command"], a.command, a.host, a.port) == (["kvpool"], "serve", "0.0.0.0", 8000)
    # The side channel's host comes from the downward API's env when the JSON names none.
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_HOST", "10.1.2.3")
    config = parse_kv_transfer_config(a.kv_transfer_config)
    assert (config.kv_connector, config.kv_role, config.kv_load_failure_policy) == ("KVPoolConnector", role, "recompute")
    ports = {p["name"]: p["containerPort"] for p in serve["ports"]}
    assert service["spec"]["ports"][0]["port"] == ports["http"] == 8000
    assert serve["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    if role == "kv_producer":
        assert (config.side_channel_host, config.side_channel_port) == ("10.1.2.3", ports["side-channel"])
        (env,) = serve["env"]
        assert env == {"name": "VLLM_NIXL_SIDE_CHANNEL_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}


def test_only_decode_pods_reach_the_prefill_side_channel():
    docs = manifest()
    policy = docs[("NetworkPolicy", "kvpool-prefill-side-channel")]["spec"]
    assert policy["podSelector"]["matchLabels"] == {"app": "kvpool-prefill"}
    side_channel = parse_kv_transfer_config(build_parser().parse_args(only_container(docs[("Deployment", "kvpool-prefill")])["args"])
                                            .kv_transfer_config).side_channel_port
    decode_labels = docs[("Deployment", "kvpool-decode")]["spec"]["template"]["metadata"]["labels"]
    rules = {r["ports"][0]["port"]: r.get("from") for r in policy["ingress"]}
    assert rules == {8000: None, side_channel: [{"podSelector": {"matchLabels": decode_labels}}]}


def test_the_router_runs_pd_mode_over_the_two_services():
    docs = manifest()
    router = only_container(docs[("Deployment", "vllm-router")])
    assert router["command"] == ["vllm-router"]
    r = router_args(router["args"])
    assert r.vllm_pd_disaggregation
    for role, urls in (("prefill", [url for url, _bootstrap in r.prefill_urls]), ("decode", r.decode_urls)):
        service = docs[("Service", f"kvpool-{role}")]
        assert urls == [f"http://kvpool-{role}:{service['spec']['ports'][0]['port']}"]
    assert r.port == 8100 and docs[("Service", "vllm-router")]["spec"]["ports"][0]["port"] == 8100
    assert router["readinessProbe"]["httpGet"]["path"] == "/readiness"


def test_run_pd_sh_syntax():
    subprocess.run(["bash", "-n", str(RUN_PD)], check=True, timeout=30)


def dry_run(**env: str) -> list[list[str]]:
    """run-pd.sh --dry-run's command lines, split as the shell would."""
    env = dict({k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")}, PYTHON=sys.executable, **env)
    out = subprocess.run(["bash", str(RUN_PD), "--dry-run"], capture_output=True, text=True, check=True, timeout=30, env=env).stdout
    return [shlex.split(line) for line in out.splitlines()]


def serve_argv(argv: list[str]) -> tuple[str | None, list[str]]:
    """(the core taskset pins it to or None, kvpool serve's arguments)."""
    core = None
    if argv[0] == "taskset":
        assert argv[1] == "-c"
        core, argv = argv[2], argv[3:]
    assert argv[:3] == [sys.executable, "-m", "frontend.serve.cli"], argv
    return core, argv[3:]


def test_run_pd_sh_command_lines_pin_each_engine_and_route_in_pd_mode():
    *engines, router = dry_run(KVPOOL_PREFILL="2", KVPOOL_DECODE="3", KVPOOL_ROUTER_PORT="9000", KVPOOL_MODEL="/m")
    assert len(engines) == 5
    num_cores = int(subprocess.check_output(["nproc"], text=True)) if shutil.which("taskset") else None
    urls = {"kv_producer": [], "kv_consumer": []}
    for k, argv in enumerate(engines):
        core, args = serve_argv(argv)
        assert core == (None if num_cores is None else str(k % num_cores))
        a = build_parser().parse_args(args)
        assert (a.command, a.model, a.host, a.port) == ("serve", "/m", "127.0.0.1", 9001 + k)
        config = parse_kv_transfer_config(a.kv_transfer_config)
        assert (config.kv_load_failure_policy, config.side_channel_port) == ("recompute", 0)
        urls[config.kv_role].append(f"http://127.0.0.1:{a.port}")
    assert [len(urls["kv_producer"]), len(urls["kv_consumer"])] == [2, 3]
    r = router_args(router[1:])
    assert r.vllm_pd_disaggregation and (r.port, r.policy) == (9000, "round_robin")
    assert [url for url, _ in r.prefill_urls] == urls["kv_producer"] and r.decode_urls == urls["kv_consumer"]


def test_run_pd_sh_pins_nothing_with_pin_cores_0():
    *engines, _router = dry_run(KVPOOL_PIN_CORES="0", KVPOOL_MODEL="/m")
    assert [serve_argv(argv)[0] for argv in engines] == [None, None]


def test_run_pd_sh_refuses_a_bad_count():
    env = dict(os.environ, PYTHON=sys.executable, KVPOOL_DECODE="0")
    p = subprocess.run(["bash", str(RUN_PD), "--dry-run"], capture_output=True, text=True, timeout=30, env=env)
    assert p.returncode == 1 and "KVPOOL_DECODE must be positive" in p.stderr.replace("KVPOOL_PREFILL and ", "")


def free_base_port() -> int:
    """A port P with P (the router), P+1, P+2 (the engines) and P+90 (its metrics) free."""
    for _ in range(50):
        base = free_port()
        if base > 65000:
            continue
        try:
            for p in (base + 1, base + 2, base + 90):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return base
    raise RuntimeError("no free block of ports")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"  # a zombie is dead for us
    except (ProcessLookupError, OSError):
        return False


def run_pd_with_stand_ins(tmp_path: Path, base: int, *loadgen_args: str, **extra_env: str) -> tuple[int, str, str, list[int]]:
    """run-pd.sh with fake_kvpool.py as `kvpool serve` behind the real router, in its own
    process group (killed whole past 60 s): (exit status, stdout, stderr, the pids it started,
    each waited for a few seconds)."""
    from bench.replicas import router_binary

    require_router()
    wrapper = tmp_path / "python"
    wrapper.write_text("#!/usr/bin/env bash\n"
                       'if [ "$1" = "-m" ] && [ "$2" = frontend.serve.cli ]; then\n'
                       f'    shift 2; exec "{sys.executable}" "{FAKE}" "$@"\n'
                       "fi\n"
                       f'exec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    env = dict({k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")}, PYTHON=str(wrapper), ROUTER=router_binary(),
               PYTHONPATH=str(ROOT), KVPOOL_MODEL="tiny", KVPOOL_ROUTER_PORT=str(base), KVPOOL_LOG_DIR=str(tmp_path / "logs"),
               KVPOOL_READY_TIMEOUT="30", KVPOOL_STOP_TIMEOUT="2", **extra_env)
    proc = subprocess.Popen(["bash", str(RUN_PD), *loadgen_args], cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=10)
    pids = [int(p) for p in re.findall(r"started [\w-]+ \(pid (\d+)\)", err)]
    deadline = time.monotonic() + 5
    while any(map(alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return proc.returncode, out, err, pids


@pytest.mark.e2e
def test_run_pd_sh_end_to_end_with_stand_in_engines(tmp_path):
    base = free_base_port()
    rc, out, err, pids = run_pd_with_stand_ins(tmp_path, base, "--num-requests", "6", "--output-len", "2")
    left = [p for p in pids if alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert rc == 0, err[-3000:]
    assert len(pids) == 3 and not left
    assert re.search(r"Successful requests:\s+6\n", out), out
    prefill, decode = f"http://127.0.0.1:{base + 1}", f"http://127.0.0.1:{base + 2}"
    assert f"ready: vllm-router (PD, round_robin) at http://127.0.0.1:{base}/v1: prefill {prefill}, decode {decode}" in err
    # Every request went through both engines; only the decode engine read prompt tokens.
    assert re.search(rf"prefill-1 {prefill}: 6 requests, .* 0 prompt tokens read", err), err
    p2p = re.search(rf"decode-1 {decode}: 6 requests, .*, (\d+) prompt tokens read from a prefill engine \(p2p\)", err)
    assert p2p and int(p2p.group(1)) > 0, err
    assert f"run-pd.sh: {p2p.group(1)} prompt tokens moved from prefill to decode engines" in err
    if shutil.which("taskset"):
        num_cores = int(subprocess.check_output(["nproc"], text=True))
        started = dict(re.findall(r"started ([\w-]+) \(pid \d+\): (.*)", err))
        assert started["prefill-1"].startswith("taskset -c 0 ") and started["decode-1"].startswith(f"taskset -c {1 % num_cores} ")
    for port in (base, base + 1, base + 2):
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0, f"port {port} still served after run-pd.sh exited"


@pytest.mark.e2e
def test_run_pd_sh_stops_everything_when_an_engine_dies_at_start(tmp_path):
    rc, _out, err, pids = run_pd_with_stand_ins(tmp_path, free_base_port(), KVPOOL_SERVE_ARGS="--port notanumber")
    left = [p for p in pids if alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert rc == 1 and "exited during start-up" in err and "last lines of" in err
    assert not left
