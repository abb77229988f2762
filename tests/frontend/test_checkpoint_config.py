"""The API server's one read of config.json (frontend/checkpoint_config.py)."""

from __future__ import annotations

import json

from frontend.checkpoint_config import checkpoint_config


def test_what_the_api_server_takes_from_config_json(tmp_path):
    text = json.dumps({"model_type": "llama", "vocab_size": 300}).encode()
    (tmp_path / "config.json").write_bytes(text)
    c = checkpoint_config(tmp_path)
    assert (c.text, c.model_type, c.vocab_size) == (text, "llama", 300)


def test_a_text_configs_vocabulary_wins_as_vllms_get_vocab_size(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 10, "text_config": {"vocab_size": 262144}}))
    assert checkpoint_config(tmp_path).vocab_size == 262144


def test_no_file_bad_json_or_no_object_say_nothing(tmp_path):
    assert checkpoint_config(tmp_path) == checkpoint_config(tmp_path / "nowhere")
    assert (checkpoint_config(tmp_path).text, checkpoint_config(tmp_path).vocab_size) == (b"", None)
    for text in ("{", "[1, 2]", '{"vocab_size": true, "model_type": 3}'):
        (tmp_path / "config.json").write_text(text)
        c = checkpoint_config(tmp_path)
        assert (c.text, c.model_type, c.vocab_size) == (text.encode(), None, None)
