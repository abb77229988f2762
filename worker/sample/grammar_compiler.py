"""Compiling structured-output grammars with xgrammar, off the step path.

vLLM's ``XgrammarBackend`` (``vllm/v1/structured_output/backend_xgrammar.py``): one
``xgrammar.GrammarCompiler`` over the tokenizer's vocabulary, padded to the model's
vocab size (tokens past the tokenizer's are never allowed). Compiles run on a thread
pool of their own (``submit``), deduplicated by spec; the process loop collects the
finished ones (``take_finished``) and tells the scheduler. Compiled grammars are kept
by spec (LRU), so a row's matcher is built from one at once when the row arrives; a
spec no longer kept (a resumed row much later, or after a re-handshake) is compiled
again, synchronously, which is correct but stalls that step.

The tokenizer info is built from ``tokenizer.json`` with ``tokenizers`` alone, as
``xgrammar.TokenizerInfo.from_huggingface`` builds it from a fast tokenizer: the
vocabulary by id, the vocab type and prefix-space flag detected from the serialized
tokenizer, EOS (``tokenizer_config.json``'s eos_token) as the default stop token.
NOTE: importing xgrammar 0.2.9 imports transformers (its tokenizer_info module does,
at import time); this module imports xgrammar only at the first grammar, so a worker
that serves none never loads either, and the worker itself calls no transformers API.
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from protocol.structured_output import GrammarSpec, structural_tag_args

# NOTE: vLLM's GrammarCompiler(max_threads=8); the pool runs compiles one at a time
# per thread, each of which xgrammar may parallelise inside.
COMPILE_THREADS = 2
MAX_COMPILED = 256
# vLLM's default --structured-outputs-config.disable_any_whitespace (False).
ANY_WHITESPACE = True
_JSON_OBJECT_SCHEMA = '{"type": "object"}'


def load_xgrammar():
    import xgrammar

    return xgrammar


def tokenizer_info(model_dir: str | Path, vocab_size: int):
    """xgrammar's TokenizerInfo for the checkpoint's tokenizer, the mask ``vocab_size``
    (the model's) wide, without transformers (see the module's docstring)."""
    from tokenizers import Tokenizer

    xgr = load_xgrammar()
    model_dir = Path(model_dir)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    vocab = tok.get_vocab(with_added_tokens=True)
    encoded_vocab = [""] * vocab_size
    for token, idx in vocab.items():
        if idx < vocab_size:
            encoded_vocab[idx] = token
    metadata = xgr.TokenizerInfo._detect_metadata_from_hf(tok.to_str())
    vocab_type, add_prefix_space = metadata["vocab_type"], metadata["add_prefix_space"]
    from_vocab = xgr.TokenizerInfo._detect_vocab_type_from_vocab(vocab)
    if from_vocab is not None and from_vocab != vocab_type:
        # xgrammar trusts the vocabulary then, and how the tokenizer encodes "a".
        vocab_type = from_vocab
        ids = tok.encode("a", add_special_tokens=False).ids
        first = tok.id_to_token(ids[0]) if ids else None
        add_prefix_space = bool(first) and first.startswith("▁" if from_vocab == xgr.VocabType.BYTE_FALLBACK else "Ġ")
    eos = _eos_token_id(model_dir, vocab)
    return xgr.TokenizerInfo(encoded_vocab, vocab_type, vocab_size=vocab_size,
                             stop_token_ids=None if eos is None else [eos], add_prefix_space=add_prefix_space)


def _eos_token_id(model_dir: Path, vocab: dict[str, int]) -> int | None:
    path = model_dir / "tokenizer_config.json"
    if not path.is_file():
        return None
    eos: Any = json.loads(path.read_text(encoding="utf-8")).get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    return vocab.get(eos) if isinstance(eos, str) else None


def _with_timeout(fn, pattern: str):
    """vLLM's compile_regex_with_timeout (VLLM_REGEX_COMPILATION_TIMEOUT_S, default 5 s):
    a regex whose automaton explodes fails its request instead of holding a thread."""
    timeout = int(os.environ.get("VLLM_REGEX_COMPILATION_TIMEOUT_S", "5"))
    if timeout <= 0:
        return fn(pattern)
    executor = ThreadPoolExecutor(max_workers=1)
    try:
        return executor.submit(fn, pattern).result(timeout=timeout)
    except TimeoutError:
        raise ValueError(f"Regex compilation timed out after {timeout}s. The pattern may be too complex or contain "
                         f"constructs that cause exponential state-space explosion (e.g. nested quantifiers). "
                         f"Pattern: {pattern[:200]}") from None
    finally:
        executor.shutdown(wait=False, cancel_futures=True)


class GrammarCompiler:
    """Compiles GrammarSpecs on background threads; keeps the compiled ones by spec."""

    def __init__(self, model_dir: str | Path, vocab_size: int):
        self.model_dir, self.vocab_size = model_dir, vocab_size
        self._compiler = None  # built at the first grammar (xgrammar's import is heavy)
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._compiled: OrderedDict[GrammarSpec, Any] = OrderedDict()
        # In flight: spec -> (its future, the seq ids waiting for it).
        self._pending: dict[GrammarSpec, tuple[Future, list[int]]] = {}

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def _xgr_compiler(self):
        with self._lock:
            if self._compiler is None:
                xgr = load_xgrammar()
                info = tokenizer_info(self.model_dir, self.vocab_size)
                self._compiler = xgr.GrammarCompiler(info, max_threads=COMPILE_THREADS, cache_enabled=False)
            return self._compiler

    def _compile(self, spec: GrammarSpec):
        c = self._xgr_compiler()
        match spec.kind:
            case "json":
                return c.compile_json_schema(spec.spec, any_whitespace=ANY_WHITESPACE)
            case "json_object":
                return c.compile_json_schema(_JSON_OBJECT_SCHEMA, any_whitespace=ANY_WHITESPACE)
            case "regex":
                return _with_timeout(c.compile_regex, spec.spec)
            case "ebnf":
                return c.compile_grammar(spec.spec)
            case "lark":
                return c.compile_lark(spec.spec)
            case "structural_tag":
                return c.compile_structural_tag(*structural_tag_args(load_xgrammar(), spec.spec))
        raise ValueError(f"unknown grammar kind {spec.kind!r}")

    def submit(self, seq_ids: list[int], specs: list[GrammarSpec]) -> list[int]:
        """Start compiling; the seq ids whose grammar is already compiled (ready now)."""
        ready = []
        for seq_id, spec in zip(seq_ids, specs, strict=True):
            if spec in self._compiled:
                self._compiled.move_to_end(spec)
                ready.append(seq_id)
            elif spec in self._pending:
                self._pending[spec][1].append(seq_id)
            else:
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar")
                self._pending[spec] = (self._executor.submit(self._compile, spec), [seq_id])
        return ready

    def take_finished(self) -> tuple[list[int], list[tuple[int, str]]]:
        """Compiles that ended since the last call: the ready seq ids, and (seq id,
        error) for each that failed."""
        ready, failed = [], []
        for spec in [s for s, (f, _) in self._pending.items() if f.done()]:
            future, seq_ids = self._pending.pop(spec)
            error = future.exception()
            if error is None:
                self._keep(spec, future.result())
                ready += seq_ids
            else:
                failed += [(s, str(error)) for s in seq_ids]
        return ready, failed

    def _keep(self, spec: GrammarSpec, compiled) -> None:
        self._compiled[spec] = compiled
        self._compiled.move_to_end(spec)
        while len(self._compiled) > MAX_COMPILED:
            self._compiled.popitem(last=False)

    def compiled(self, spec: GrammarSpec):
        """The compiled grammar of ``spec``: kept, in flight (waited for), or compiled now."""
        if spec in self._compiled:
            self._compiled.move_to_end(spec)
            return self._compiled[spec]
        if spec in self._pending:
            compiled = self._pending[spec][0].result()
        else:
            compiled = self._compile(spec)
        self._keep(spec, compiled)
        return compiled

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
