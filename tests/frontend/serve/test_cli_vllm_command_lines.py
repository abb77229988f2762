"""Real ``vllm serve`` command lines, verbatim, parsed by ``kvpool serve``: each either
parses (and its flags reach the right child) or is refused by name with the reason.
Nothing is started: parse_serve and Launcher.build only."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from frontend.serve.cli import Refused, parse_serve
from frontend.serve.launcher import Launcher

DEPLOY = Path(__file__).resolve().parents[3] / "deploy"


def words(command: str) -> list[str]:
    """The command's words as a POSIX shell splits them (a backslash-newline continues the line)."""
    return shlex.split(command.replace("\\\n", " "))


def children(command: str) -> dict[str, list[str]]:
    argv = words(command)
    assert argv[:2] in (["vllm", "serve"], ["kvpool", "serve"]), argv
    launcher = Launcher(parse_serve(argv[1:]), log=lambda *a, **k: None)
    launcher.build()
    return {name: c.argv for name, c in launcher.children.items()}


def value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def refusal(command: str) -> str:
    with pytest.raises(Refused) as e:
        parse_serve(words(command)[1:])
    line = str(e.value)
    assert "\n" not in line and line.startswith("kvpool serve: --")
    return line


def test_the_model_first_form():
    # vllm/utils/argparse_utils.py (FlexibleArgumentParser.parse_args, its comment "[After]")
    c = children("vllm serve <model> -tp 2 --enforce-eager --port 8001")
    assert value(c["worker"], "--tensor-parallel-size") == "2" and value(c["frontend"], "--port") == "8001"
    assert value(c["frontend"], "--served-model-name") == "<model>"


def test_the_model_flag_form():
    # vllm/utils/argparse_utils.py (FlexibleArgumentParser.parse_args, its comment "[Before]")
    c = children("vllm serve -tp 2 --model <model> --enforce-eager --port 8001")
    assert value(c["worker"], "--tensor-parallel-size") == "2" and value(c["frontend"], "--port") == "8001"
    assert value(c["worker"], "--model").endswith("<model>")


def test_the_cli_usage_page_model_configuration():
    # https://www.mintlify.com/vllm-project/vllm/serving/cli-usage ("Model configuration")
    c = children("vllm serve meta-llama/Llama-3.2-1B-Instruct --dtype auto --max-model-len 4096 --trust-remote-code")
    assert "--dtype" not in c["worker"] and value(c["scheduler"], "--max-model-len") == "4096"  # auto: the worker's default


def test_data_parallel_is_refused_with_the_replicas_advice():
    # https://www.mintlify.com/vllm-project/vllm/serving/cli-usage ("Single node, multiple GPUs")
    line = refusal("vllm serve meta-llama/Llama-3.2-1B-Instruct --data-parallel-size 4 --tensor-parallel-size 2")
    assert line.startswith("kvpool serve: --data-parallel-size 4: ") and "vllm-router" in line


def test_a_headless_node_is_refused():
    # https://www.mintlify.com/vllm-project/vllm/serving/cli-usage ("Multi-node with internal load balancing", node 1)
    line = refusal("vllm serve meta-llama/Llama-3.2-1B-Instruct --headless --data-parallel-size 4 --data-parallel-size-local 2 "
                   "--data-parallel-start-rank 2 --data-parallel-address 10.99.48.128 --data-parallel-rpc-port 13345")
    assert line.startswith("kvpool serve: --headless: ")


def test_the_weight_cache_daemon_load_format_is_refused():
    # vllm/entrypoints/cli/preload.py (module docstring)
    line = refusal("vllm serve /path/to/model --tensor-parallel-size 4 --load-format ipc_cache")
    assert line == "kvpool serve: --load-format ipc_cache: kvpool's worker loads safetensors weights its own way; vLLM's loader options do not apply"


def test_an_attention_backend_is_refused():
    # vllm/model_executor/models/config.py (the FlexAttention example)
    line = refusal("""vllm serve baidu/Unlimited-OCR \\
                --attention-config '{"backend": "FLEX_ATTENTION"}'""")
    assert line.startswith("kvpool serve: --attention-config ") and "its own PyTorch model code" in line


def test_a_kv_connector_other_than_kvpools_is_refused():
    # vllm/distributed/kv_transfer/kv_connector/v1/decode_bench_connector.py (module docstring)
    line = refusal("""vllm serve <model> --kv-transfer-config '{
            "kv_connector": "DecodeBenchConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "fill_mean": 0.015,
                "fill_std": 0.0
            }
        }'""")
    assert line.startswith("kvpool serve: --kv-transfer-config: kv_connector 'DecodeBenchConnector' is not supported by kvpool")
    assert "KVPoolConnector, NixlConnector" in line


def test_grpc_is_refused():
    # vllm/entrypoints/grpc_server.py (its deprecation message)
    assert refusal("vllm serve <model_path> --grpc") == "kvpool serve: --grpc: kvpool serves HTTP only, no gRPC server"


def test_tool_calling_is_passed_and_other_parsers_refused():
    # vllm/tool_parsers/llama_tool_parser.py ("Used when --enable-auto-tool-choice --tool-call-parser llama3_json")
    c = children("vllm serve <model> --enable-auto-tool-choice --tool-call-parser llama3_json")
    assert "--enable-auto-tool-choice" in c["frontend"] and value(c["frontend"], "--tool-call-parser") == "llama3_json"
    # vllm/tool_parsers/mistral_tool_parser.py: a parser vLLM has and kvpool does not
    line = refusal("vllm serve <model> --enable-auto-tool-choice --tool-call-parser mistral")
    assert line == "kvpool serve: --tool-call-parser mistral: kvpool has only the hermes, llama3_json, llama4_json tool-call parsers"


def test_the_repo_systemd_unit():
    # deploy/systemd/kvpool-serve.service, ExecStart (continuation lines joined)
    text = (DEPLOY / "systemd" / "kvpool-serve.service").read_text()
    start = text.split("ExecStart=", 1)[1].split("\n# ", 1)[0].replace("\\\n", " ")
    argv = shlex.split(start)
    c = children(shlex.join(["kvpool", *argv[1:]]))
    assert value(c["worker"], "--kv-cache-memory") == "256MiB" and value(c["frontend"], "--port") == "8000"
    assert value(c["worker"], "--http-port") == "8001"


def test_underscored_flags_as_vllm_takes_them():
    # vLLM's FlexibleArgumentParser turns --max_num_batched_tokens into --max-num-batched-tokens
    c = children("vllm serve mistralai/Mistral-7B-Instruct-v0.3 --trust-remote-code --enable-chunked-prefill --max_num_batched_tokens 1024")
    assert value(c["scheduler"], "--max-num-batched-tokens") == "1024" and "--enable-chunked-prefill" in c["scheduler"]
