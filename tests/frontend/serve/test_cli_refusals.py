"""A ``vllm serve`` flag kvpool cannot honour: ``kvpool serve`` exits 2 with one line
naming the flag and why, and starts nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from frontend.serve import launcher
from frontend.serve.cli import main

REPO = Path(__file__).resolve().parents[3]


def test_a_refused_flag_exits_2_with_one_line_and_starts_nothing(tiny_checkpoint, tmp_path):
    p = subprocess.run([sys.executable, "-m", "frontend.serve.cli", "serve", str(tiny_checkpoint), "--port", "8123", "--enable-lora",
                        "--log-dir", str(tmp_path / "logs")], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr == "kvpool serve: --enable-lora: LoRA adapters are not supported: kvpool serves the base model only\n"
    assert not (tmp_path / "logs").exists()  # each child would log there


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--kv-cache-dtype", "int8_per_token_head"],
         "kvpool serve: --kv-cache-dtype int8_per_token_head: kvpool's KV cache is the model's dtype (auto; choose it with --dtype) "
         "or fp8 (fp8, fp8_e4m3, fp8_e5m2), the ones vLLM's CPU attention supports; other cache dtypes are not supported yet"),
        (["--data-parallel-rank", "1"], "kvpool serve: --data-parallel-rank 1: a kvpool serve is one engine, data-parallel size 1, "
                                        "whose rank is 0 as vLLM's is then; independent replicas all keep rank 0 (tell them apart "
                                        "by --kv-events-topic)"),
        (["--kv-offloading-backend", "lmcache"],
         "kvpool serve: --kv-offloading-backend lmcache: LMCache is not supported; kvpool's tiers are its host tier (native) and its disk or mooncake tiers"),
        (["--log-level", "CRITICAL"], "kvpool serve: --log-level CRITICAL: kvpool's processes log at DEBUG, INFO, WARNING or ERROR"),
        (["--served-model-name", "a", "b"],
         "kvpool serve: --served-model-name a b: kvpool serves one model name (several are not supported yet)"),
        (["--tokenizer", "/elsewhere"], "kvpool serve: --tokenizer /elsewhere: a tokenizer from another folder than MODEL is not "
                                        "supported yet (kvpool reads MODEL's tokenizer.json)"),
        (["-dp", "2"], "kvpool serve: --data-parallel-size 2: a kvpool serve is one engine on one host; for more, run several "
                       "kvpool serve replicas behind vllm-router (deploy/run-router.sh)"),
        (["--no-enforce-eager"], "kvpool serve: --no-enforce-eager: kvpool never compiles the model or captures CUDA graphs: "
                                 "its worker always runs eagerly"),
        (["--per-request-spec-decode-metrics", "all"],
         "kvpool serve: --per-request-spec-decode-metrics all: per-request speculative decoding metrics are not supported yet "
         "(the vllm:spec_decode_* counters are)"),
        (["--reasoning-parser", "deepseek_r1"], "kvpool serve: --reasoning-parser deepseek_r1: reasoning parsers are not supported yet"),
        (["--quantization", "awq"], "kvpool serve: --quantization awq: quantized checkpoints are not supported: kvpool loads "
                                    "unquantized safetensors weights"),
    ],
    ids=lambda x: x[0] if isinstance(x, list) else None,
)
def test_the_line_names_the_flag_as_given_and_why(tiny_checkpoint, monkeypatch, capsys, argv, line):
    monkeypatch.setattr(launcher, "main_serve", lambda a: pytest.fail("a refused flag reached main_serve"))
    assert main(["serve", str(tiny_checkpoint), *argv]) == 2
    assert capsys.readouterr().err == line + "\n"


@pytest.mark.parametrize(
    "argv",
    [["-dp", "1"], ["--kv-cache-dtype", "auto"], ["--enforce-eager"], ["--pipeline-parallel-size", "1"], ["--no-enable-lora"],
     ["--distributed-executor-backend", "mp"], ["--tokenizer", "."], ["--quantization", "None"]],
    ids=lambda x: " ".join(x),
)
def test_what_vllm_does_as_kvpool_does_anyway_is_accepted(tiny_checkpoint, monkeypatch, argv):
    started = []
    monkeypatch.setattr(launcher, "main_serve", lambda a: started.append(a) or 0)
    monkeypatch.chdir(tiny_checkpoint)  # --tokenizer . is MODEL's own folder
    assert main(["serve", str(tiny_checkpoint), *argv]) == 0 and len(started) == 1


def test_several_refused_flags_still_make_one_line(tiny_checkpoint, capsys):
    assert main(["serve", str(tiny_checkpoint), "--enable-lora", "--kernel-config", "{}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvpool serve: --enable-lora: ")
