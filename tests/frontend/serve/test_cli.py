"""`kvpool serve`'s flags (named as `vllm serve`'s) and what each child process is given,
checked without starting anything."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from frontend.serve.cli import build_parser, parse_serve
from frontend.serve.launcher import Launcher


def built(argv: list[str], model_dir: Path) -> dict[str, list[str]]:
    launcher = Launcher(parse_serve(["serve", str(model_dir), *argv]), log=lambda *x, **k: None)
    launcher.build()
    return {name: c.argv for name, c in launcher.children.items()}


def value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_vllm_serve_flags_reach_the_right_process(tiny_checkpoint):
    argv = built(["--host", "127.0.0.1", "--port", "8123", "--served-model-name", "tiny", "--dtype", "float32",
                  "--block-size", "32", "--num-gpu-blocks-override", "100", "--max-num-seqs", "8",
                  "--max-num-batched-tokens", "512", "--max-model-len", "1000", "--no-enable-prefix-caching",
                  "--gpu-memory-utilization", "0.5", "--generation-config", "vllm", "--kv-cache-memory", "8MiB",
                  "--kv-events-endpoint", "tcp://127.0.0.1:5999", "--seed", "1234"], tiny_checkpoint)
    s, w, f = argv["scheduler"], argv["worker"], argv["frontend"]
    assert value(s, "--block-size") == value(w, "--block-size") == "32"
    # the worker allocates exactly the override's blocks (as vLLM), the scheduler pools them
    assert value(s, "--num-gpu-blocks-override") == value(w, "--num-gpu-blocks-override") == "100" and value(s, "--max-num-seqs") == "8"
    assert value(s, "--max-num-batched-tokens") == "512" and "--no-enable-prefix-caching" in s
    assert value(s, "--max-model-len") == value(w, "--max-model-len") == value(f, "--max-model-len") == "1000"
    assert value(s, "--served-model-name") == value(f, "--served-model-name") == "tiny"
    assert value(s, "--kv-events-endpoint") == "tcp://127.0.0.1:5999"
    assert value(w, "--dtype") == "float32" and value(w, "--kv-cache-memory") == "8MiB"
    assert value(w, "--gpu-memory-utilization") == "0.5"
    assert value(w, "--seed") == "1234" and "--seed" not in s and "--seed" not in f
    assert value(f, "--port") == "8123" and value(f, "--generation-config") == "vllm"
    # internal sockets: loopback, ports chosen free and shared by the right ends
    assert value(s, "--host") == "127.0.0.1"
    assert value(w, "--scheduler") == f"tcp://127.0.0.1:{value(s, '--worker-port')}"
    assert value(f, "--scheduler") == f"tcp://127.0.0.1:{value(s, '--port')}"
    assert value(f, "--scheduler-http") == f"http://127.0.0.1:{value(s, '--http-port')}"


def test_the_request_body_limit_reaches_the_frontend(tiny_checkpoint, capsys):
    assert value(built([], tiny_checkpoint)["frontend"], "--max-request-body-bytes") == str(4 << 20)  # the frontend's own default
    assert value(built(["--max-request-body-bytes", "1000"], tiny_checkpoint)["frontend"], "--max-request-body-bytes") == "1000"
    from frontend.serve.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", str(tiny_checkpoint), "--max-request-body-bytes", "0"])
    assert e.value.code == 2 and "--max-request-body-bytes must be positive, got 0" in capsys.readouterr().err


def test_the_worker_restart_timeout_is_the_schedulers_wait_for_a_worker(tiny_checkpoint, capsys):
    assert value(built([], tiny_checkpoint)["scheduler"], "--worker-reconnect-timeout") == "30.0"
    assert value(built(["--worker-restart-timeout", "90"], tiny_checkpoint)["scheduler"], "--worker-reconnect-timeout") == "90.0"
    from frontend.serve.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", str(tiny_checkpoint), "--worker-restart-timeout", "0"])
    assert e.value.code == 2 and "--worker-restart-timeout must be a positive number of seconds, got 0.0" in capsys.readouterr().err


def test_the_logging_flags_reach_their_process(tiny_checkpoint):
    default = built([], tiny_checkpoint)
    assert "--disable-log-stats" not in default["scheduler"] and "--enable-log-requests" not in default["frontend"]
    flagged = built(["--disable-log-stats", "--enable-log-requests"], tiny_checkpoint)
    assert "--disable-log-stats" in flagged["scheduler"] and "--enable-log-requests" in flagged["frontend"]


def test_the_full_sequence_admission_gate_is_on_unless_turned_off(tiny_checkpoint):
    assert "--no-scheduler-reserve-full-isl" not in built([], tiny_checkpoint)["scheduler"]
    assert "--no-scheduler-reserve-full-isl" in built(["--no-scheduler-reserve-full-isl"], tiny_checkpoint)["scheduler"]


def test_the_global_seed_defaults_to_0_as_vllm_v1(tiny_checkpoint):
    from worker.__main__ import config_from_args as worker_config

    # NOTE: a setting left at its default is not written: the child's default is the same table row's.
    worker = built([], tiny_checkpoint)["worker"]
    assert "--seed" not in worker and worker_config(worker[3:] + ["--device", "cpu"]).seed == 0
    assert value(built(["--seed", "7"], tiny_checkpoint)["worker"], "--seed") == "7"


def test_two_launches_get_different_internal_ports(tiny_checkpoint):
    a, b = built([], tiny_checkpoint), built([], tiny_checkpoint)
    assert value(a["scheduler"], "--port") != value(b["scheduler"], "--port")


def test_the_served_name_defaults_to_model_as_given(tiny_checkpoint):
    a = build_parser().parse_args(["serve", "./some/dir"])
    assert a.served_model_name is None and a.model == "./some/dir"  # cli.main fills in the name as given


def test_a_model_that_is_not_a_folder_is_refused(tmp_path, capsys):
    from frontend.serve.cli import main

    assert main(["serve", str(tmp_path / "nope")]) == 2
    assert "is not a checkpoint folder" in capsys.readouterr().err


def _serve_exits(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "frontend.serve.cli", "serve", *argv], capture_output=True, text=True, timeout=60)


def _copy_without(src: Path, dest: Path, *left_out: str) -> Path:
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns(*left_out))
    return dest


@pytest.mark.parametrize(
    ("left_out", "words"),
    [
        (("*",), "no config.json (a checkpoint folder needs config.json, *.safetensors and tokenizer.json)"),
        (("*.safetensors",), "no *.safetensors weights"),
        (("tokenizer.json",), "no tokenizer.json"),
    ],
    ids=["empty", "no-weights", "no-tokenizer"],
)
def test_an_incomplete_checkpoint_is_one_clear_line_before_anything_starts(tiny_checkpoint, tmp_path, left_out, words):
    model = _copy_without(tiny_checkpoint, tmp_path / "m", *left_out)
    p = _serve_exits([str(model), "--log-dir", str(tmp_path / "logs")])
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kvpool serve: {model}: ") and words in lines[0], p.stderr
    assert not (tmp_path / "logs").exists()  # no process was started (each would log there)


def test_a_config_that_is_not_json_is_named(tiny_checkpoint, tmp_path):
    model = _copy_without(tiny_checkpoint, tmp_path / "m")
    (model / "config.json").write_text("{not json")
    p = _serve_exits([str(model)])
    assert p.returncode == 2 and "config.json is not readable JSON" in p.stderr and "Traceback" not in p.stderr


def test_unknown_flag_is_refused():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "m", "--no-such-flag"])


def test_kv_offloading_size_goes_to_the_scheduler_and_the_worker(tiny_checkpoint):
    argv = built(["--kv-offloading-size", "0.5"], tiny_checkpoint)
    assert value(argv["scheduler"], "--kv-offloading-size") == value(argv["worker"], "--kv-offloading-size") == "0.5"
    assert "--kv-offloading-size" not in argv["frontend"]
    off = built([], tiny_checkpoint)
    assert "--kv-offloading-size" not in off["scheduler"] and "--kv-offloading-size" not in off["worker"]


def test_auto_tool_choice_needs_a_parser_before_anything_starts(tiny_checkpoint, capsys):
    # vllm/entrypoints/launchers/cli_args.py validate_parsed_serve_args
    from frontend.serve.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", str(tiny_checkpoint), "--enable-auto-tool-choice"])
    assert e.value.code == 2 and "--enable-auto-tool-choice requires --tool-call-parser" in capsys.readouterr().err
    c = built(["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--tool-strict-level", "function"], tiny_checkpoint)["frontend"]
    assert "--enable-auto-tool-choice" in c and value(c, "--tool-call-parser") == "hermes" and value(c, "--tool-strict-level") == "function"
