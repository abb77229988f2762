"""Structured outputs on the worker: the tokenizer info xgrammar needs, built without
transformers, equals xgrammar's own from transformers' tokenizer; a row with a grammar
can only sample what its grammar allows (greedy too) and stops on EOS once it is
complete; rows without one are untouched; a row resumed after preemption goes on
exactly as if it never stopped."""

from __future__ import annotations

import json
import shutil
import time

import pytest
import torch
from tokenizers import Tokenizer

from protocol.sampling_params import GREEDY
from protocol.structured_output import GrammarSpec, RowGrammar
from protocol.worker_messages import RequestRow, RowSampling, StepPlan
from worker.kv.kv_cache import allocate_kv_caches
from worker.load.checkpoint import Checkpoint
from worker.models.loader import load_model
from worker.sample.grammar_bitmask import GrammarRows
from worker.sample.grammar_compiler import GrammarCompiler, tokenizer_info
from worker.step.runner import ModelRunner

xgr = pytest.importorskip("xgrammar")

VOCAB_SIZE, EOS = 512, 1  # the tiny default checkpoint's
BS, NUM_BLOCKS, MAX_SEQS, MAX_LEN = 4, 64, 4, 64
PROMPT_A, PROMPT_B = [11, 22, 33, 44, 55], [7, 8, 9]
CHOICES = ("yes", "no", "maybe")
CHOICE = GrammarSpec("ebnf", 'root ::= "yes" | "no" | "maybe"')
DIGITS = GrammarSpec("regex", "[0-9]+")


@pytest.mark.parametrize("padded", [False, True])
def test_tokenizer_info_equals_xgrammars_from_transformers(tiny_checkpoint, tmp_path, padded):
    from transformers import AutoTokenizer

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_checkpoint / name, tmp_path / name)
    # A model whose vocabulary is wider than its tokenizer's (padded lm_head).
    vocab_size = VOCAB_SIZE + 88 if padded else VOCAB_SIZE
    ours = tokenizer_info(tmp_path, vocab_size)
    theirs = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(str(tmp_path)), vocab_size=vocab_size)
    assert ours.serialize_json() == theirs.serialize_json()
    assert ours.vocab_size == vocab_size and ours.stop_token_ids == [EOS]


def test_tokenizer_info_of_a_byte_fallback_tokenizer(tmp_path):
    """A Llama-2-style tokenizer (SentencePiece BPE with byte fallback, "▁" for spaces,
    which transformers 5 loads as LlamaTokenizer): the other vocabulary type xgrammar knows."""
    import json

    from tokenizers import decoders, models, normalizers, trainers
    from transformers import AutoTokenizer

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    special = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    tok.train_from_iterator(["the cat sat on the mat", "hello world", "a b c d"] * 20,
                            trainers.BpeTrainer(vocab_size=320, special_tokens=special, show_progress=False))
    tok.save(str(tmp_path / "tokenizer.json"))
    config = {"eos_token": "</s>", "bos_token": "<s>", "unk_token": "<unk>", "tokenizer_class": "LlamaTokenizerFast"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours = tokenizer_info(tmp_path, 352)
    theirs = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(str(tmp_path)), vocab_size=352)
    assert ours.vocab_type == xgr.VocabType.BYTE_FALLBACK and ours.add_prefix_space
    assert ours.serialize_json() == theirs.serialize_json()


@pytest.fixture(scope="module")
def compiler(tiny_checkpoint):
    return GrammarCompiler(tiny_checkpoint, VOCAB_SIZE)


@pytest.fixture(scope="module")
def texts(tiny_checkpoint) -> list[str]:
    tok = Tokenizer.from_file(str(tiny_checkpoint / "tokenizer.json"))
    special = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    return ["" if tok.id_to_token(i) in special else tok.decode([i]) for i in range(VOCAB_SIZE)]


def test_bitmask_allows_only_what_the_grammar_allows(compiler, texts):
    rows = GrammarRows(compiler, MAX_SEQS, VOCAB_SIZE)
    rows.add(2, RowGrammar(DIGITS, [EOS]), [])
    logits = torch.randn(3, VOCAB_SIZE, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    rows.apply(logits, [0, 2, 3])  # batch row 1 is table row 2
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    allowed = {i for i in range(VOCAB_SIZE) if logits[1, i] > float("-inf")}
    # By hand: at the start of [0-9]+ a token is allowed iff its text is all digits (EOS not yet).
    assert allowed == {i for i, t in enumerate(texts) if t and t.isascii() and t.isdigit()}
    assert all(logits[1, i] == before[1, i] for i in allowed)


def test_a_structural_tag_allows_free_text_until_its_trigger_then_its_schema(compiler, texts, tiny_checkpoint):
    # The legacy form vLLM's xgrammar backend still compiles: <n>{"n": integer}</n> after "<n>".
    tag = {"structures": [{"begin": "<n>", "schema": {"type": "object", "properties": {"n": {"type": "integer"}},
                                                        "required": ["n"]}, "end": "</n>"}], "triggers": ["<n>"]}
    spec = RowGrammar(GrammarSpec("structural_tag", json.dumps(tag)), [EOS])
    trigger = Tokenizer.from_file(str(tiny_checkpoint / "tokenizer.json")).encode("<n>", add_special_tokens=False).ids
    rows = GrammarRows(compiler, MAX_SEQS, VOCAB_SIZE)
    rows.add(0, spec, [])  # nothing written yet: free text
    rows.add(1, spec, trigger)  # the trigger written: the schema's object must open
    logits = torch.zeros(2, VOCAB_SIZE)
    rows.apply(logits, [0, 1])
    free = {i for i in range(VOCAB_SIZE) if logits[0, i] > float("-inf")}
    assert set(trigger) <= free and EOS in free
    opened = {i for i in range(VOCAB_SIZE) if logits[1, i] > float("-inf")}
    assert opened and all(texts[i].startswith("{") for i in opened)


def finished(compiler) -> tuple[list[int], list[tuple[int, str]]]:
    """Wait (bounded) until some compile in flight ends."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        ready, failed = compiler.take_finished()
        if ready or failed:
            return ready, failed
        time.sleep(0.005)
    raise AssertionError("no compile ended within 30 s")


def test_submit_deduplicates_and_reports(compiler):
    spec = GrammarSpec("regex", "[a-c]{2}")
    assert compiler.submit([7, 8], [spec, spec]) == []  # one compile for both
    assert finished(compiler) == ([7, 8], [])
    assert not compiler.has_pending
    assert compiler.submit([9], [spec]) == [9]  # kept: ready at once
    assert compiler.submit([10], [GrammarSpec("ebnf", "root ::= (")]) == []
    ready, failed = finished(compiler)
    assert ready == [] and [s for s, _ in failed] == [10] and failed[0][1]


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return load_model(Checkpoint(tiny_checkpoint), torch.float32, "cpu")


def new_runner(model, compiler) -> ModelRunner:
    c = model.config
    caches = allocate_kv_caches(c.num_layers, NUM_BLOCKS, BS, c.num_kv_heads, c.head_dim, torch.float32, "cpu")
    return ModelRunner(model, caches, MAX_SEQS, MAX_LEN, grammar_compiler=compiler)


def row(seq_id, tokens, num_prompt, grammar=None) -> RequestRow:
    blocks = list(range(1 + 16 * seq_id, 1 + 16 * seq_id + 16))
    sampling = None if grammar is None else RowSampling(num_prompt, GREEDY, RowGrammar(grammar, [EOS]))
    return RequestRow(seq_id, list(tokens), blocks, 0, sampling)


def decode(runner, steps, first_step=1) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for step in range(first_step, first_step + steps):
        r = runner.execute(StepPlan(step))
        for sid, tok in zip(r.seq_ids, r.sampled_token_ids, strict=True):
            out.setdefault(sid, []).append(tok)
    return out


def test_greedy_row_follows_its_grammar_and_ends_on_eos(model, compiler, texts):
    plain = new_runner(model, compiler)
    plain.execute(StepPlan(0, {1: 5, 2: 3}, new_rows=[row(1, PROMPT_A, 5), row(2, PROMPT_B, 3)]))
    free = decode(plain, 8)
    r = new_runner(model, compiler)
    first = r.execute(StepPlan(0, {1: 5, 2: 3}, new_rows=[row(1, PROMPT_A, 5, CHOICE), row(2, PROMPT_B, 3)]))
    outs = decode(r, 8)
    a = [first.sampled_token_ids[0], *outs[1]]
    b = [first.sampled_token_ids[1], *outs[2]]
    end = a.index(EOS)
    assert "".join(texts[t] for t in a[:end]) in CHOICES  # the choice, then EOS at once
    assert a[:end] != [plain.rows[1].token_ids[5 + i] for i in range(end)]  # the mask changed what greedy picked
    # The row without a grammar is untouched.
    assert b == plain.rows[2].token_ids[3:3 + len(b)] and b[1:] == free[2][: len(b) - 1]


def test_resumed_row_rebuilds_its_matcher(model, compiler, texts):
    # NOTE: a grammar whose allowed tokens depend on how far the output is: a matcher
    # started afresh at resumption would demand the "x" again.
    spec, prompt = GrammarSpec("regex", "x[0-9]{3}y[a-z]{3}z"), [40, 41, 42]
    ref = new_runner(model, compiler)
    ref.execute(StepPlan(0, {1: 3}, new_rows=[row(1, prompt, 3, spec)]))
    decode(ref, 12)
    expected = ref.rows[1].token_ids[3:]
    assert EOS in expected
    end = expected.index(EOS)
    assert __import__("re").fullmatch("x[0-9]{3}y[a-z]{3}z", "".join(texts[t] for t in expected[:end]))
    r = new_runner(model, compiler)
    r.execute(StepPlan(0, {1: 3}, new_rows=[row(1, prompt, 3, spec)]))
    decode(r, 2)
    tokens = r.rows[1].token_ids
    # Preempted, then resumed whole: its prompt and the 3 tokens it has.
    r.execute(StepPlan(3, preempted_seq_ids=[1]))
    r.execute(StepPlan(4, {1: len(tokens)}, resumed_rows=[row(1, tokens, 3, spec)]))
    decode(r, 9, first_step=5)
    assert r.rows[1].token_ids[3:] == expected


def test_float64_logits_are_masked_as_xgrammar_masks_float32(compiler):
    rows = GrammarRows(compiler, MAX_SEQS, VOCAB_SIZE)
    rows.add(0, RowGrammar(DIGITS, [EOS]), [])
    rows.add(1, RowGrammar(CHOICE, [EOS]), [])
    logits = torch.randn(3, VOCAB_SIZE, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    as32 = logits.float()
    rows.apply(as32, [0, 3, 1])
    rows.apply(logits, [0, 3, 1])
    assert torch.equal(torch.isinf(logits), torch.isinf(as32)) and torch.isinf(logits).sum() > 0
