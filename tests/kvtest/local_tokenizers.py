"""Checkpoints whose tokenizer transformers (hence vLLM) reads differently from what a
naive reader of ``tokenizer.json`` gets, built locally from the tiny checkpoint (its
weights, another tokenizer): nothing is downloaded.

* ``metaspace_checkpoint``: a SentencePiece-style tokenizer (Llama 2, Mistral): a BPE
  with a Metaspace pre-tokenizer and decoder, whose decoder drops the space it
  prepended to the first word of a text -- so a continuation decoded on its own loses
  its leading space -- and a post-processor that adds ``<s>``.
* ``wordpiece_tokenizer``: a WordPiece tokenizer (BERT's decoder: a space before every
  token but ``##`` pieces) with two added special tokens, where vLLM's
  ``spaces_between_special_tokens`` shows.
* ``qwen2_checkpoint``: the tiny checkpoint's byte-level tokenizer under a ``qwen2``
  config: transformers 5 builds Qwen2's tokenizer (its own pre-tokenizer, which splits
  digits one by one) whatever tokenizer.json says.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

# Words the Metaspace BPE is trained on (no download: a fixed text).
_CORPUS = [
    "the cat sat on the mat and the dog lay by the door",
    "hello world, this is a small test of a sentence piece tokenizer",
    "numbers like 12 345 and 2024 appear in text too",
    "Über café naïve résumé 日本語 — quotes \"and\" 'marks'!",
] * 20
METASPACE_SPECIALS = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>"]


def _copy_weights(tiny: Path, d: Path) -> None:
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        if (tiny / name).is_file():
            shutil.copy(tiny / name, d / name)


def metaspace_checkpoint(tiny: str | Path, directory: str | Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tiny, d = Path(tiny), Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    vocab = json.loads((tiny / "config.json").read_text())["vocab_size"]
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=METASPACE_SPECIALS, show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    tok.save(str(d / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
              "model_max_length": 131072,
              "chat_template": "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
                               "{% if add_generation_prompt %}<|assistant|>{% endif %}"}
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    _copy_weights(tiny, d)
    return d


def qwen2_checkpoint(tiny: str | Path, directory: str | Path) -> Path:
    """Only the tokenizer files and a qwen2 config.json: enough for a tokenizer, not a model."""
    tiny, d = Path(tiny), Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / name, d / name)
    config = json.loads((tiny / "config.json").read_text())
    config.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"])
    (d / "config.json").write_text(json.dumps(config))
    return d


def wordpiece_tokenizer(directory: str | Path) -> Path:
    """Tokenizer files only: vocabulary hello, world, ##s; added tokens [A] and [B]."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordPiece({"[UNK]": 0, "hello": 1, "world": 2, "##s": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens([AddedToken("[A]", special=True), AddedToken("[B]", special=True)])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]"}))
    return d
