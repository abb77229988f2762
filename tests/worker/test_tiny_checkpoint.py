"""The tiny default checkpoint: the same files byte for byte every time, in the format
the ecosystem reads (transformers and tokenizers load it), a few million parameters."""

from __future__ import annotations

import os
import subprocess
import sys

from worker.tiny.generate import NAME, write_tiny_checkpoint

FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


def test_generated_byte_for_byte_the_same_in_separate_processes(tmp_path, tiny_checkpoint):
    code = "import sys; from worker.tiny.generate import write_tiny_checkpoint; write_tiny_checkpoint(sys.argv[1])"
    for i, hash_seed in enumerate(("1", "2")):
        env = dict(os.environ, PYTHONHASHSEED=hash_seed, RAYON_NUM_THREADS=str(i + 1))
        subprocess.run([sys.executable, "-c", code, str(tmp_path / f"run{i}")], check=True, env=env, timeout=120)
    assert sorted(os.listdir(tmp_path / "run0")) == FILES
    for f in FILES:
        a = (tmp_path / "run0" / f).read_bytes()
        assert a == (tmp_path / "run1" / f).read_bytes(), f
        assert a == (tiny_checkpoint / f).read_bytes(), f  # and the cached default is the same
    assert tiny_checkpoint.name == NAME


def test_transformers_and_tokenizers_read_it(tiny_checkpoint, tiny_reference):
    from transformers import AutoTokenizer

    n = sum(p.numel() for p in tiny_reference.parameters())
    assert 2_000_000 < n < 6_000_000  # a few million: fast on 2 cores
    assert type(tiny_reference).__name__ == "LlamaForCausalLM"
    tok = AutoTokenizer.from_pretrained(str(tiny_checkpoint))
    assert (tok.bos_token_id, tok.eos_token_id, len(tok)) == (0, 1, 512)
    text = "The scheduler owns every block."
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text and len(ids) < len(text) / 2  # real merges, not bytes
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|bos|><|user|>hi<|eos|><|assistant|>"


def test_writing_again_into_the_same_directory_gives_the_same_files(tmp_path):
    d = write_tiny_checkpoint(tmp_path / "x")
    before = {f: (d / f).read_bytes() for f in FILES}
    write_tiny_checkpoint(d)
    assert {f: (d / f).read_bytes() for f in FILES} == before


def test_default_checkpoint_goes_to_the_cache_folder(tiny_checkpoint):
    assert str(tiny_checkpoint).startswith(os.environ["KVPOOL_CACHE_DIR"])
