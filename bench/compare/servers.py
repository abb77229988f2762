"""The two servers of ``make compare`` — ``vllm serve`` from ``.venv-vllm`` and ``kvpool
serve`` from the project's venv — started with the same settings, one at a time, each in
a process group of its own so that stopping it stops every process it started; and
their ``/metrics``: counters read before and after a workload, the KV usage gauge
sampled while it runs.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from bench.kv_block_bytes import kv_bytes_per_block

COUNTERS = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions",
            "vllm:prompt_tokens", "vllm:generation_tokens")
USAGE = "vllm:kv_cache_usage_perc"
# kvpool's exact peak of USAGE since start, taken at every allocation (vLLM has none: its
# side's peak is the sampled one).
PEAK = "kvpool_peak_kv_cache_usage_perc"


@dataclass(frozen=True)
class ServerConfig:
    """What both engines are given alike."""

    block_size: int = 32
    num_blocks: int = 256
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    dtype: str = "float32"
    prefix_caching: bool = True
    # NOTE: the metrics row compares the pages: vLLM registers its kv_block_* residency
    # histograms (on the shared dashboard) only with --kv-cache-metrics, so both get it,
    # sampled alike (the engines' defaults differ: vLLM 0.01, kvpool 1.0) at vLLM's rate,
    # so that the throughput figures pay little and the same for it.
    kv_cache_metrics: bool = True
    kv_cache_metrics_sample: float = 0.01
    # --kv-cache-dtype on both (auto, fp8, fp8_e4m3, fp8_e5m2).
    kv_cache_dtype: str = "auto"
    # > 0: both pools sized from this KV space (vLLM's VLLM_CPU_KVCACHE_SPACE, kvpool's
    # --kv-cache-memory), each engine counting its own blocks; 0: num_blocks on both.
    kv_space_gib: int = 0

    def bytes_per_block(self, model: Path) -> int:
        """One block's K and V in the layers a block holds: every layer with one KV-cache
        group, ``num_kv_tensors`` of them with several (vLLM's page of a hybrid model), as
        the launcher sizes kvpool's pool."""
        per_block = kv_bytes_per_block(model, self.block_size, self.dtype, 1, self.kv_cache_dtype)
        if per_block is None:
            raise ValueError(f"{model / 'config.json'} does not give the KV cache's shape")
        return per_block

    def common_flags(self) -> list[str]:
        return ["--block-size", str(self.block_size), *([] if self.kv_space_gib else ["--num-gpu-blocks-override", str(self.num_blocks)]),
                *([] if self.kv_cache_dtype == "auto" else ["--kv-cache-dtype", self.kv_cache_dtype]),
                "--max-num-seqs", str(self.max_num_seqs), "--max-num-batched-tokens", str(self.max_num_batched_tokens),
                "--max-model-len", str(self.max_model_len), "--dtype", self.dtype,
                "--enable-prefix-caching" if self.prefix_caching else "--no-enable-prefix-caching",
                *(["--kv-cache-metrics", "--kv-cache-metrics-sample", str(self.kv_cache_metrics_sample)]
                  if self.kv_cache_metrics else ["--no-kv-cache-metrics"])]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(engine: str, model: Path, port: int, cfg: ServerConfig, root: Path, name: str) -> list[str]:
    """The command line of one engine's server; everything else about them is equal."""
    common = [str(model), "--host", "127.0.0.1", "--port", str(port), "--served-model-name", name, *cfg.common_flags()]
    if engine == "vllm":
        return [str(root / ".venv-vllm/bin/vllm"), "serve", *common, "--seed", "0"]
    if engine == "kvpool":
        # NOTE: KV memory for exactly the blocks asked (the null block included), so both
        # pools hold num_blocks; the override then only confirms it.
        kv = cfg.kv_space_gib * 2**30 if cfg.kv_space_gib else cfg.num_blocks * cfg.bytes_per_block(model)
        return [str(root / ".venv/bin/kvpool"), "serve", *common, "--kv-cache-memory", str(kv)]
    raise ValueError(f"unknown engine {engine!r}: vllm or kvpool")


def vllm_env(cache: Path, cfg: ServerConfig, model: Path, threads: int | None) -> dict[str, str]:
    """vLLM's CPU knobs: the CPU platform, KV space in GiB (the block override decides the
    pool), its compute threads bound to the first ``threads`` cores this process may use
    (None: no binding given, vLLM's own default, "auto", which binds every core but one),
    torch.compile's caches in a folder this run controls."""
    gib = cfg.kv_space_gib or max(1, -(-cfg.num_blocks * cfg.bytes_per_block(model) // 2**30))
    env = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": str(gib),
           "VLLM_CACHE_ROOT": str(cache / "vllm"), "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}
    if threads is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in sorted(os.sched_getaffinity(0))[:threads])
    return env


class Server:
    """One engine's server, started in its own session; a context manager that always stops it."""

    def __init__(self, engine: str, cmd: list[str], env: dict[str, str], log: Path, port: int):
        self.engine, self.cmd, self.log_path, self.port = engine, cmd, log, port
        self.url = f"http://127.0.0.1:{port}"
        self.env = {**os.environ, **env}
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Server:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.engine} server exited with {self.proc.returncode} before ready; see {self.log_path}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.engine} server not ready after {timeout_s:g} s; see {self.log_path}")

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM to the whole process group, SIGKILL after timeout_s."""
        if self.proc is None:
            return
        try:
            stop_process_group(self.proc, timeout_s)
        finally:
            self.proc = None
            self._log.close()


def stop_process_group(proc: subprocess.Popen, timeout_s: float = 20.0) -> None:
    """Stop a process started with ``start_new_session=True`` and everything it started:
    SIGTERM to its group while the leader runs, SIGKILL to the group after timeout_s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
    # NOTE: the group, not only the leader: vLLM's engine core (or compile workers) and
    # kvpool's children must not outlive the run.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(5)


def scrape_page(url: str, timeout_s: float = 5.0) -> str:
    """A server's whole /metrics page."""
    with urllib.request.urlopen(url + "/metrics", timeout=timeout_s) as r:
        return r.read().decode()


def num_gpu_blocks(page: str) -> int | None:
    """The pool's block count, as both engines label vllm:cache_config_info with it."""
    for fam in text_string_to_metric_families(page):
        if fam.name == "vllm:cache_config_info":
            for s in fam.samples:
                value = s.labels.get("num_gpu_blocks")
                if value and value != "None":
                    return int(value)
    return None


def scrape(url: str, timeout_s: float = 5.0) -> dict[str, float]:
    """Each counter of COUNTERS and the USAGE gauge, summed over their label sets; PEAK
    where the server has it."""
    text = scrape_page(url, timeout_s)
    out = dict.fromkeys((*COUNTERS, USAGE), 0.0)
    for fam in text_string_to_metric_families(text):
        if fam.name in out:
            out[fam.name] += sum(s.value for s in fam.samples if s.name in (fam.name, fam.name + "_total"))
        elif fam.name == PEAK and fam.samples:
            out[PEAK] = max(s.value for s in fam.samples)
    return out


class UsageSampler(threading.Thread):
    """Samples the KV usage gauge every period_s until stopped; keeps the peak."""

    def __init__(self, url: str, period_s: float = 0.1):
        super().__init__(daemon=True)
        self.url, self.period_s, self.peak = url, period_s, 0.0
        self.num_samples = 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.period_s):
            try:
                self.peak = max(self.peak, scrape(self.url)[USAGE])
                self.num_samples += 1
            except (urllib.error.URLError, OSError, ValueError):
                pass

    def stop(self) -> float:
        self._stop_event.set()
        self.join(10)
        return self.peak
