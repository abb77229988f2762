"""vLLM's ways of spelling a flag, taken by kvpool serve as vLLM's FlexibleArgumentParser
takes them: underscores, ``-O3``, and a JSON config flag one field at a time."""

from __future__ import annotations

import json

import pytest

from frontend.serve.cli import Refused, parse_serve
from frontend.serve.flags.spelling import normalize_flag_names
from frontend.serve.launcher import Launcher


def test_underscores_in_names_only():
    argv = ["--max_model_len=2k", "--served_model_name", "my_model", "--scheduler-args", "--max_num_waiting 5"]
    assert normalize_flag_names(argv) == ["--max-model-len=2k", "--served-model-name", "my_model", "--scheduler-args",
                                          "--max_num_waiting 5"]


@pytest.mark.parametrize("argv", [["-O0"], ["-O=0"], ["-O", "0"], ["--optimization-level", "0"]])
def test_the_o_forms_are_the_optimization_level(argv):
    assert normalize_flag_names(argv) == ["--optimization-level", "0"]
    parse_serve(["serve", "m", *argv])  # -O0: no compilation, kvpool's behaviour


def test_o3_is_refused_by_its_long_name():
    with pytest.raises(Refused, match=r"^kvpool serve: --optimization-level 3: kvpool never compiles"):
        parse_serve(["serve", "m", "-O3"])


def test_dotted_fields_merge_into_one_json_flag_after_the_rest():
    argv = ["--kv-events-config.enable_kv_cache_events", "true", "--port", "1", "--kv-events-config.topic=kv",
            "--kv-events-config.buffer_steps", "2k", "--x.a.b", "plain", "--x.list+", "a,b"]
    assert normalize_flag_names(argv) == [
        "--port", "1", "--kv-events-config", json.dumps({"enable_kv_cache_events": True, "topic": "kv", "buffer_steps": 2000}),
        "--x", json.dumps({"a": {"b": "plain"}, "list": ["a", "b"]}),
    ]


def test_a_dotted_kv_events_config_reaches_the_scheduler():
    la = Launcher(parse_serve(["serve", "m", "--kv-events-config.enable_kv_cache_events", "true",
                               "--kv-events-config.endpoint", "tcp://router:5557"]), log=lambda *a, **k: None)
    la.build()
    s = la.children["scheduler"].argv
    assert s[s.index("--kv-events-endpoint") + 1] == "tcp://router:5557" and "vllm" in s


def test_a_dotted_field_of_a_refused_config_is_refused_by_the_flags_name():
    with pytest.raises(Refused, match=r"^kvpool serve: --compilation-config '\{\"pass_config\": \{\"fuse_norm_quant\": true\}\}': "):
        parse_serve(["serve", "m", "--compilation-config.pass_config.fuse_norm_quant", "true"])
