"""``kvpool serve --config FILE.yaml``: vLLM's YAML of flags. The file's flags come
first and the command line overrides them; a bad file is one clear line, exit 2,
before anything starts."""

from __future__ import annotations

import textwrap

import pytest

from frontend.serve.cli import build_parser, main, parse_serve
from frontend.serve.flags.config_file import config_flags
from frontend.serve.launcher import Launcher

CONFIG = textwrap.dedent("""\
    model: /models/tiny
    port: 8123
    tensor_parallel_size: 2
    enable-prefix-caching: false
    enforce-eager: true
    api-key: [k1, k2]
    max_model_len: 2k
    kv-events-config:
      enable_kv_cache_events: true
      endpoint: "tcp://127.0.0.1:5557"
    disable-log-stats: false
""")

# What vLLM 0.32's FlexibleArgumentParser.load_config_file returned for CONFIG (run once
# with .venv-vllm), underscores then turned into dashes as its parse_args does.
VLLM_FLAGS = ["--model", "/models/tiny", "--port", "8123", "--tensor-parallel-size", "2", "--no-enable-prefix-caching",
              "--enforce-eager", "--api-key", "k1", "k2", "--max-model-len", "2k",
              "--kv-events-config", '{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:5557"}']


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text(CONFIG)
    return path


def value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_the_files_flags_are_vllms(config):
    assert config_flags(str(config), set(build_parser().serve_parser._option_string_actions)) == VLLM_FLAGS


def test_the_file_gives_the_model_and_the_command_line_overrides_it(config):
    a = parse_serve(["serve", "--config", str(config), "-tp", "4", "--port", "9000"])
    assert a.model == "/models/tiny" and a.tensor_parallel_size == 4 and a.port == 9000
    assert a.enable_prefix_caching is False and a.max_model_len == 2000 and a.given["api_key"] == ["k1", "k2"]
    assert a.disable_log_stats is False  # false for a flag without a --no- form: left out, as vLLM does


def test_a_positional_model_wins_over_the_files(config):
    a = parse_serve(["serve", "/cli/model", "--config", str(config)])
    assert a.model == "/cli/model" and a.port == 8123


def test_the_files_flags_reach_the_children(config):
    la = Launcher(parse_serve(["serve", f"--config={config}"]), log=lambda *x, **k: None)
    la.build()
    s, w, f = (la.children[n].argv for n in ("scheduler", "worker", "frontend"))
    assert "--no-enable-prefix-caching" in s and value(s, "--kv-events-endpoint") == "tcp://127.0.0.1:5557"
    assert value(w, "--tensor-parallel-size") == "2" and value(f, "--port") == "8123"
    assert f[f.index("--api-key") : f.index("--api-key") + 3] == ["--api-key", "k1", "k2"]


def test_a_refused_flag_in_the_file_is_refused_by_name(tmp_path, capsys):
    path = tmp_path / "lora.yml"
    path.write_text("enable-lora: true\nmax-loras: 4\n")
    assert main(["serve", "m", "--config", str(path)]) == 2
    assert capsys.readouterr().err == "kvpool serve: --enable-lora: LoRA adapters are not supported: kvpool serves the base model only\n"


@pytest.mark.parametrize(
    ("name", "text", "words"),
    [
        ("bad.yaml", "port: 8000\n  tensor-parallel-size: [2\n", "is not valid YAML at line 2"),
        ("list.yaml", "- port\n- 8000\n", "expected a mapping of flag: value, got a list"),
        ("serve.json", '{"port": 8000}', "the file must be YAML (.yaml or .yml)"),
    ],
    ids=["bad-yaml", "not-a-mapping", "not-yaml"],
)
def test_a_bad_file_is_one_clear_line(tmp_path, capsys, name, text, words):
    path = tmp_path / name
    path.write_text(text)
    assert main(["serve", "m", "--config", str(path), "--log-dir", str(tmp_path / "logs")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"kvpool serve: --config {path}") and words in err, err
    assert not (tmp_path / "logs").exists()


def test_a_missing_file_and_two_files_are_named(tmp_path, capsys):
    assert main(["serve", "m", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "nope.yaml: cannot be read (No such file or directory)" in capsys.readouterr().err
    path = tmp_path / "a.yaml"
    path.write_text("port: 1\n")
    assert main(["serve", "m", "--config", str(path), "--config", str(path)]) == 2
    assert "--config is given more than once" in capsys.readouterr().err


def test_a_file_without_a_model_and_no_model_given_is_refused(tmp_path, capsys):
    path = tmp_path / "a.yaml"
    path.write_text("port: 1\n")
    with pytest.raises(SystemExit) as e:
        parse_serve(["serve", "--config", str(path)])
    assert e.value.code == 2 and "no model: give MODEL, --model MODEL or model: in the --config file" in capsys.readouterr().err
