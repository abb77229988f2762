"""frontend.text.tokenizer against transformers' AutoTokenizer on the same files (vLLM's tokenizer)."""

from __future__ import annotations

import json

import pytest
from kvtest.unicode_texts import TEXTS

from frontend.text.tokenizer import Tokenizer, TokenizerError


@pytest.fixture(scope="module")
def tok(tiny_checkpoint):
    return Tokenizer(tiny_checkpoint)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_equals_transformers(tok, hf_tokenizer, text, add_special_tokens):
    expected = hf_tokenizer(text, add_special_tokens=add_special_tokens).input_ids
    assert tok.encode(text, add_special_tokens=add_special_tokens) == expected


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip", [True, False])
def test_decode_equals_transformers(tok, hf_tokenizer, text, skip):
    ids = hf_tokenizer(text).input_ids + [1, 0]
    assert tok.decode(ids, skip_special_tokens=skip) == hf_tokenizer.decode(ids, skip_special_tokens=skip)


def test_special_tokens_come_from_tokenizer_config(tok, hf_tokenizer):
    assert tok.all_special_ids == hf_tokenizer.all_special_ids
    assert (tok.bos_token_id, tok.eos_token_id) == (hf_tokenizer.bos_token_id, hf_tokenizer.eos_token_id) == (0, 1)
    assert tok.special_tokens_map == {"bos_token": "<|bos|>", "eos_token": "<|eos|>"}
    assert tok.vocab_size == len(hf_tokenizer)


def test_a_post_processor_that_adds_bos_is_honoured(bos_checkpoint):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(bos_checkpoint))
    tok = Tokenizer(bos_checkpoint)
    for text in TEXTS:
        assert tok.encode(text) == hf(text).input_ids
        assert tok.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False).input_ids
    assert tok.encode("hi")[0] == 0


def test_chat_template_file_wins_over_the_config_key(bos_checkpoint, tiny_checkpoint):
    assert Tokenizer(bos_checkpoint).chat_template.startswith("{% for m in messages %}")
    assert Tokenizer(tiny_checkpoint).chat_template == json.loads((tiny_checkpoint / "tokenizer_config.json").read_text())["chat_template"]


def test_a_special_token_missing_from_the_vocabulary_is_added_as_transformers_does(tiny_checkpoint, tmp_path):
    from transformers import AutoTokenizer

    (tmp_path / "tokenizer.json").write_bytes((tiny_checkpoint / "tokenizer.json").read_bytes())
    config = json.loads((tiny_checkpoint / "tokenizer_config.json").read_text())
    config["pad_token"] = "<|pad|>"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    tok = Tokenizer(tmp_path)
    assert tok.token_id("pad_token") == hf.pad_token_id is not None
    assert tok.encode("a <|pad|> b") == hf("a <|pad|> b").input_ids
    assert tok.decode(tok.encode("a <|pad|> b")) == hf.decode(hf("a <|pad|> b").input_ids, skip_special_tokens=True)


def test_a_folder_without_tokenizer_json_is_refused_by_name(tmp_path):
    with pytest.raises(TokenizerError, match="has no tokenizer.json"):
        Tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="not a readable tokenizer"):
        Tokenizer(tmp_path)


def test_a_qwen2_checkpoint_tokenizes_as_transformers_builds_it(tiny_checkpoint, tmp_path):
    """transformers 5 builds Qwen2's tokenizer from the model type (digits split one by
    one), not from tokenizer.json's pre-tokenizer: the ids are what vLLM's get_tokenizer gets."""
    from kvtest.local_tokenizers import qwen2_checkpoint
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import AutoTokenizer

    d = qwen2_checkpoint(tiny_checkpoint, tmp_path / "qwen2")
    hf = AutoTokenizer.from_pretrained(str(d))
    tok = Tokenizer(d)
    text = "in 2024 there were 12345 cats"
    assert tok.encode(text) == hf(text).input_ids
    assert tok.encode(text) != RawTokenizer.from_file(str(d / "tokenizer.json")).encode(text).ids  # the test means something
    for t in TEXTS:
        assert tok.encode(t, add_special_tokens=False) == hf(t, add_special_tokens=False).input_ids


def test_encode_async_runs_in_the_tokenizer_thread_with_the_same_ids(tok, hf_tokenizer):
    import asyncio
    import threading

    async def main():
        ids = await asyncio.gather(*(tok.encode_async(t) for t in TEXTS))
        return ids, threading.get_ident()

    ids, loop_thread = asyncio.run(main())
    assert ids == [hf_tokenizer(t).input_ids for t in TEXTS]
    names = {t.name for t in threading.enumerate()}
    assert any(n.startswith("tokenizer") for n in names) and loop_thread is not None


def test_model_types_vllm_loads_as_the_generic_backend(tiny_checkpoint, tmp_path):
    """vLLM's get_tokenizer bypasses AutoTokenizer for a few model types whose hub
    tokenizer_class is wrong (_MODEL_TYPES_WITH_INCORRECT_TOKENIZER_CLASS)."""
    from kvtest.local_tokenizers import qwen2_checkpoint

    d = qwen2_checkpoint(tiny_checkpoint, tmp_path / "internlm2")
    assert type(Tokenizer(d).hf).__name__ == "Qwen2Tokenizer"
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "model_type": "internlm2"}))
    assert type(Tokenizer(d).hf).__name__ == "TokenizersBackend"


def test_a_metaspace_tokens_logprob_text_keeps_its_leading_space(tiny_checkpoint, tmp_path):
    """vLLM's convert_ids_list_to_tokens puts back the leading space a Metaspace decoder
    strips from a token decoded alone. Expected: vLLM 0.32's own function run on this
    tokenizer (recorded); a byte-level tokenizer's text is its plain decode."""
    from kvtest.local_tokenizers import metaspace_checkpoint

    tok = Tokenizer(metaspace_checkpoint(tiny_checkpoint, tmp_path / "metaspace"))
    ids = tok.encode(" sat on the mat <|user|> 日本", add_special_tokens=False) + [1, 2]
    assert ids == [133, 147, 51, 120, 44, 3, 110, 46, 1, 2]
    assert [tok.token_text(i) for i in ids] == [" sat", " on", " the", " mat", " ", "<|user|>", " 日", "本", "<s>", "</s>"]
    assert tok.hf.decode([133]) == "sat"  # what a plain decode gives
    byte_level = Tokenizer(tiny_checkpoint)
    assert [byte_level.token_text(i) for i in byte_level.encode(" sat on")] == [byte_level.hf.decode([i]) for i in byte_level.encode(" sat on")]
