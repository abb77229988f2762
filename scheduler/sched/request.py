"""A request as the scheduler sees it: tokens, progress, and its block hashes."""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable, Sequence
from typing import Any

from protocol.kv_transfer_params import KVTransferParams
from protocol.sampling_params import GREEDY, SamplingParams
from protocol.structured_output import GrammarSpec, RowGrammar
from protocol.worker_messages import RowSampling
from scheduler.core.hashing import BlockHasher
from scheduler.core.kv_cache_block import BlockHash


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    # Its grammar is still compiling on the worker (scheduler/sched/grammar_wait.py).
    WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR = "waiting_for_structured_output_grammar"
    # Its blocks are being loaded from the external tier (scheduler/sched/external_wait.py).
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_LENGTH = "length"
    FINISHED_STOPPED = "stop"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def is_finished(self) -> bool:
        return self.value in ("length", "stop", "abort", "error")


class Request:
    """One generation request.

    ``all_token_ids`` is the prompt followed by the output so far; ``block_hashes``
    holds the hash of every full block of it, kept up to date as tokens arrive.
    """

    __slots__ = (
        "request_id", "seq_id", "client_id", "all_token_ids", "num_prompt_tokens",
        "max_tokens", "ignore_eos", "eos_token_id", "cache_salt", "status", "num_computed_tokens",
        "num_cached_tokens", "num_external_cached_tokens", "block_hashes", "block_hasher", "arrival_time", "scheduled_time",
        "first_token_time",
        "last_token_time", "num_preemptions", "alloc_noop_until", "max_num_tokens", "stop_token_ids", "append_only_below",
        "min_tokens", "sampling", "priority", "grammar", "skip_reading_prefix_cache",
        "prompt_logprobs", "spec_token_ids", "draft_index", "external_load",
        "kv_transfer_params", "kv_transfer_answer", "num_replay_tokens",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        max_tokens: int,
        *,
        seq_id: int = 0,
        client_id: bytes = b"",
        ignore_eos: bool = False,
        eos_token_id: int | Sequence[int] | None = None,
        cache_salt: str | None = None,
        block_hasher: BlockHasher | None = None,
        arrival_time: float | None = None,
        block_hashes: list[BlockHash] | None = None,
        stop_token_ids: Iterable[int] = (),
        min_tokens: int = 0,
        sampling: SamplingParams | None = None,
        priority: int = 0,
        grammar: GrammarSpec | None = None,
    ):
        self.request_id = request_id
        self.seq_id = seq_id
        # The ROUTER identity of the client that sent it (opaque to the policy).
        self.client_id = client_id
        # NOTE: the prompt is held once, as the head of all_token_ids (a waiting
        # queue of long prompts is most of the scheduler's memory).
        self.all_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.max_tokens = max_tokens
        self.ignore_eos = ignore_eos
        self.eos_token_id = eos_token_id
        self.cache_salt = cache_salt
        self.status = RequestStatus.WAITING
        # Tokens whose K/V are in the cache (or scheduled to be, in the step in flight).
        self.num_computed_tokens = 0
        # Prompt tokens served by the prefix cache at first admission; -1 until then.
        # Of them, those loaded from the host tier (vLLM's external KV transfer).
        self.num_cached_tokens = -1
        self.num_external_cached_tokens = 0
        self._init_loads()
        # NOTE: ``block_hashes`` lets a caller that already hashed the prompt (the
        # offline what-if replay memoises shared trace prefixes) pass them in: they must
        # be what ``block_hasher`` would give; it hashes on from where they end.
        self.block_hashes: list[BlockHash] = [] if block_hashes is None else list(block_hashes)
        self.block_hasher = block_hasher
        if block_hasher is not None:
            block_hasher.extend_block_hashes(self.block_hashes, self.all_token_ids, cache_salt)
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        # vLLM's SCHEDULED event: first admission (time.monotonic()); None until then.
        self.scheduled_time: float | None = None
        # vLLM's request priority: lower runs first under --scheduling-policy priority
        # (ties by arrival_time); the fcfs policy ignores it.
        self.priority = priority
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        # Preemptions by the policy (out of blocks); a lost worker's recompute is not one.
        self.num_preemptions = 0
        # The KV cache manager's, written by its allocations and free only (see
        # KVCacheRequest); the scheduler reads it for its decode fast path.
        self.alloc_noop_until = 0
        self._init_stops_and_sampling(max_tokens, ignore_eos, eos_token_id, stop_token_ids, min_tokens, sampling, grammar)
        # The prompt logprobs the worker sent so far, until the first token takes them
        # (scheduler.sched.prompt_logprobs); None when not asked, or not yet.
        self.prompt_logprobs = None
        # The scheduler's (the core never sees it): while the request holds fewer
        # tokens than this, a sampled token fills no block, reaches no limit and is
        # not its first: it is only appended (update_from_output's fast path). 0: not yet.
        self.append_only_below = 0
        # Speculative decoding (scheduler/spec/): the draft tokens to verify in its next
        # step (never in all_token_ids, never hashed), and the proposer's state for it (its
        # n-gram index, or its suffix tree).
        self.spec_token_ids: list[int] = []
        self.draft_index = None

    def _init_loads(self) -> None:
        """Nothing loading, nothing to pull or lend yet."""
        # While its blocks load from the external tier or a prefill engine: (its tokens computed
        # before the load, the blocks loading, its device hits' tokens, the tokens loading,
        # whether it is a pull from a prefill engine); None otherwise.
        self.external_load: tuple[int, int, int, int, bool] | None = None
        # P/D disaggregation (scheduler/sched/pd_connector.py): the request's params (None
        # once its blocks were pulled), and a prefill engine's answer, for its last output.
        self.kv_transfer_params: KVTransferParams | None = None
        self.kv_transfer_answer: dict[str, Any] | None = None
        # Prompt tokens loaded whole but computed again (vLLM's replay: the last one of a prompt a
        # prefill engine computed, to sample from); its prefill stats count them as loaded.
        self.num_replay_tokens = 0

    def _init_stops_and_sampling(self, max_tokens: int, ignore_eos: bool, eos_token_id: int | Sequence[int] | None,
                                 stop_token_ids: Iterable[int], min_tokens: int, sampling: SamplingParams | None,
                                 grammar: GrammarSpec | None) -> None:
        """Where it stops, and what the worker samples it with."""
        # Where it stops: at this many tokens (the scheduler caps it at max_model_len),
        # or after sampling one of stop_token_ids (the model's EOS ids unless
        # ignore_eos, and the request's own), once it has min_tokens outputs.
        self.max_num_tokens = self.num_prompt_tokens + max_tokens
        eos = () if eos_token_id is None or ignore_eos else (eos_token_id,) if isinstance(eos_token_id, int) else eos_token_id
        self.stop_token_ids = frozenset((*eos, *stop_token_ids))
        self.min_tokens = min_tokens
        # What the worker samples with (None: greedy, no logprobs).
        # Structured outputs (None: none); it travels with the row, with every stop id
        # (vLLM's all_stop_token_ids: EOS even with ignore_eos) to end its matcher.
        self.grammar = grammar
        if grammar is not None:
            eos_ids = () if eos_token_id is None else (eos_token_id,) if isinstance(eos_token_id, int) else eos_token_id
            row_grammar = RowGrammar(grammar, sorted({*stop_token_ids, *eos_ids}))
            self.sampling = RowSampling(self.num_prompt_tokens, sampling or GREEDY, row_grammar)
        else:
            self.sampling = None if sampling is None else RowSampling(self.num_prompt_tokens, sampling)
        # vLLM's: a request for prompt logprobs never reads the prefix cache (every prompt
        # position must be computed to be scored); it still caches its own full blocks.
        self.skip_reading_prefix_cache = sampling is not None and sampling.prompt_logprobs is not None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.all_token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    def append_output_token_id(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        if self.block_hasher is not None and len(self.all_token_ids) % self.block_hasher.block_size == 0:
            self.block_hasher.extend_block_hashes(self.block_hashes, self.all_token_ids, self.cache_salt)

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        """Append several sampled tokens at once (as many append_output_token_id calls)."""
        self.all_token_ids.extend(token_ids)
        if self.block_hasher is not None:
            self.block_hasher.extend_block_hashes(self.block_hashes, self.all_token_ids, self.cache_salt)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, seq_id={self.seq_id}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, {self.status.value})"
        )
