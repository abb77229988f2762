"""Shared fixtures of the frontend tests: checkpoint folders and transformers' view of them."""

from __future__ import annotations

import json
import shutil

import pytest


@pytest.fixture(scope="session")
def hf_tokenizer(tiny_checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_checkpoint))


@pytest.fixture(scope="session")
def bos_checkpoint(tiny_checkpoint, tmp_path_factory):
    """The tiny checkpoint's tokenizer with a post-processor that adds BOS (as Llama's
    tokenizer.json has), the chat template moved to chat_template.jinja (where
    transformers 5 writes it) and given to the config as well, differently."""
    d = tmp_path_factory.mktemp("bos-tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_checkpoint / name, d / name)
    tok = json.loads((d / "tokenizer.json").read_text())
    tok["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|bos|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": "<|bos|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|bos|>": {"id": "<|bos|>", "ids": [0], "tokens": ["<|bos|>"]}},
    }
    (d / "tokenizer.json").write_text(json.dumps(tok))
    config = json.loads((d / "tokenizer_config.json").read_text())
    (d / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if loop.first and m['role'] == 'system' %}[SYS]{{ m['content'] | trim }}\n"
        "{% else %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    config["chat_template"] = "{{ 'the config template: not used when chat_template.jinja exists' }}"
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


@pytest.fixture(scope="session")
def served(tiny_checkpoint, tmp_path_factory):
    """One live `kvpool serve` of the tiny checkpoint for the API tests."""
    from kvtest.serve import kvpool_serve

    with kvpool_serve(tiny_checkpoint, tmp_path_factory.mktemp("serve-logs"), "--max-model-len", "1024", "--dev-mode",
                      "--enable-prompt-tokens-details") as s:
        yield s


@pytest.fixture(scope="session")
def client(served):
    import openai

    return openai.OpenAI(base_url=served.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def model(served, tiny_checkpoint):
    return str(tiny_checkpoint)


@pytest.fixture(scope="session")
def hf(tiny_checkpoint):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_checkpoint))
    m = AutoModelForCausalLM.from_pretrained(str(tiny_checkpoint), dtype=torch.float32).eval()
    return tok, m
