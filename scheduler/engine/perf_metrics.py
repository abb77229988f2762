"""vLLM's MFU estimates (--enable-mfu-metrics): the flops and bytes a step costs per GPU.

vLLM 0.32's vllm/v1/metrics/perf.py, for the models kvpool serves: dense llama-style
decoders (attention with grouped KV heads, a SwiGLU FFN, an unembedding), no
mixture of experts, no MLA, no quantization. Each scheduled request adds
``(num_tokens, context_len, is_prefill)`` to the step's `StepContext` as vLLM's
``get_step_perf_stats_per_gpu`` adds it (context_len: its computed tokens once the
step's are counted; a request sent whole for the first time is a prefill, any other
one a prefill when it computes more than one token); `estimate_step` sums vLLM's
AttentionMetrics, FfnMetrics and UnembedMetrics breakdowns, each term truncated to
an int as there, with tensor parallelism over ``tp_size`` ranks and no pipeline or
data parallelism. The element sizes (weights and activations, the KV cache) are the
worker's, as its hello reports them (``WorkerHello.dtype_size``, ``kv_cache_dtype_size``):
the scheduler keeps no dtype table of its own.

NOTE: vLLM bills sliding-window layers with contexts clamped to the window; kvpool's
worker serves such a model only with max_model_len within its window, where the
clamp changes nothing, so the window is not modelled here.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.worker_messages import WorkerHello
from scheduler.engine.model_shape import ModelShape
from scheduler.sched.outputs import SchedulerOutput


@dataclass(slots=True)
class StepContext:
    """vLLM's ExecutionContext: one step's batch, prefill and decode apart."""

    num_prefill_requests: int = 0
    prefill_num_tokens: int = 0
    prefill_context_len: int = 0
    decode_num_tokens: int = 0
    decode_context_len: int = 0
    token_context_product: int = 0

    def add(self, num_tokens: int, context_len: int, is_prefill: bool) -> None:
        self.token_context_product += num_tokens * context_len
        if is_prefill:
            self.num_prefill_requests += 1
            self.prefill_num_tokens += num_tokens
            self.prefill_context_len += context_len
        else:
            self.decode_num_tokens += num_tokens
            self.decode_context_len += context_len

    @classmethod
    def of_step(cls, out: SchedulerOutput) -> StepContext:
        """The step just scheduled (its requests' computed tokens include the step's)."""
        ctx = cls()
        counts = out.plan.num_scheduled_tokens
        new = {row.seq_id for row in out.plan.new_rows}
        for request in out.scheduled:
            num_tokens = counts.get(request.seq_id, 1)
            ctx.add(num_tokens, request.num_computed_tokens, request.seq_id in new or num_tokens > 1)
        return ctx


def estimate_step(m: ModelShape, worker: WorkerHello, ctx: StepContext) -> tuple[int, int, int]:
    """(flops, bytes read, bytes written) per GPU, as vLLM's attn + ffn + unembed, with the
    worker's tensor-parallel size and element sizes: its weights' (b) and its KV cache's
    (cb, vLLM's cache_byte_size: 1 for fp8).

    NOTE: the attention terms take the layer count as a float, as vLLM's (it divides
    it by the pipeline stages), and are truncated to ints term by term as there."""
    D, L, d, b, cb = m.hidden_size, m.num_hidden_layers, m.head_dim, worker.dtype_size, worker.kv_cache_dtype_size
    tp_size = worker.world_size
    Lf = float(L)
    q, kv = max(1, m.num_attention_heads // tp_size), max(1, m.num_key_value_heads // tp_size)
    DI, V = m.intermediate_size // tp_size, m.vocab_size // tp_size
    P, Pc, N, Nc = ctx.prefill_num_tokens, ctx.prefill_context_len, ctx.decode_num_tokens, ctx.decode_context_len
    T, TC, logits = P + N, ctx.token_context_product, ctx.num_prefill_requests + N
    flops = (
        int(2 * T * D * (q + 2 * kv) * d * Lf) + int(2 * T * D * q * d * Lf) + 2 * int(2 * q * TC * d * Lf)  # attention
        + 2 * D * 3 * DI * T * L  # ffn (up, gate, down)
        + 2 * logits * D * V  # unembed
    )
    attn_input = 0.0
    if P:
        attn_input += (P * q + 2 * Pc * kv) * d * b * Lf
    if N:
        attn_input += N * q * d * b * Lf + 2 * Nc * kv * d * cb * Lf  # NOTE: as vLLM, a prefill's context is counted at b
    read = (
        int(T * D * b * Lf) + int(D * (q + 2 * kv) * d * b * Lf) + int(attn_input) + int(T * q * d * b * Lf)  # attention
        + int(q * d * D * b * Lf)
        + T * D * b * L + 2 * D * DI * b * L + 2 * T * DI * b * L + T * DI * b * L + D * DI * b * L  # ffn
        + logits * D * b + D * V * b  # unembed
    )
    write = (
        int(T * (q + 2 * kv) * d * b * Lf) + int(2 * T * kv * d * cb * Lf) + int(T * D * b * Lf)  # attention: qkv, KV cache, out
        + 2 * T * DI * b * L + T * DI * b * L + T * D * b * L  # ffn
        + logits * V * b  # unembed
    )
    return flops, read, write
