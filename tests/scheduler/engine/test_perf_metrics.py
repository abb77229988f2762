"""--enable-mfu-metrics: vLLM's estimated_*_per_gpu counters, as vllm/v1/metrics/perf.py
estimates a dense llama-style model (AttentionMetrics + FfnMetrics + UnembedMetrics),
on a tiny model worked out by hand, in the element sizes the worker's hello reports; the
step's batch as vLLM's ExecutionContext sees it; the flags; and the live process."""

from __future__ import annotations

import json

import pytest
from kvtest.fake_worker import FakeWorker
from kvtest.scheduler_harness import Setup, metric, prompt_of

from protocol.worker_messages import WorkerHello
from scheduler.core.hashing import BlockHasher
from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.engine.args import config_from_args
from scheduler.engine.model_shape import ModelShape
from scheduler.engine.perf_metrics import StepContext, estimate_step
from scheduler.sched.request import Request
from scheduler.sched.scheduler import Scheduler

# L=2 layers, D=8, 2 heads, 1 KV head, head_dim 4, intermediate 16, vocab 32, bf16 (2 bytes).
TINY = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "hidden_size": 8, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 4, "intermediate_size": 16, "vocab_size": 32, "torch_dtype": "bfloat16"}
# By hand from perf.py's breakdowns for TINY at tp 1, with T tokens, TC = sum(tokens x context),
# P/Pc prefill tokens/context, N/Nc decode tokens/context, logits = prefill requests + N:
#   flops = qkv 512T + out 256T + qk, av 2 x 32TC + ffn 1536T + unembed 512 logits
#   read  = attn 64T + 768 + 32(P + Pc + N + Nc) + ffn 224T + 1536 + unembed 16 logits + 512
#   write = attn 128T + ffn 224T + unembed 64 logits


def worker(tp: int = 1, dtype_size: int = 2, kv_cache_dtype_size: int = 2) -> WorkerHello:
    """The hello of a worker of ``tp`` ranks that serves in these element sizes (bf16 by default)."""
    return WorkerHello(0, tp, 64, 16, 32, 1, dtype_size=dtype_size, kv_cache_dtype_size=kv_cache_dtype_size)


def flops(T, TC, logits):
    return 2304 * T + 64 * TC + 512 * logits


def read(T, P, Pc, N, Nc, logits):
    return 288 * T + 32 * (P + Pc + N + Nc) + 16 * logits + 2816


def write(T, logits):
    return 352 * T + 64 * logits


@pytest.fixture
def tiny_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    return tmp_path


def test_a_mixed_step_by_hand(tiny_dir):
    shape = ModelShape.from_checkpoint(str(tiny_dir))
    assert shape == ModelShape(2, 8, 2, 1, 4, 16, 32)
    ctx = StepContext()
    ctx.add(3, 3, True)  # a 3-token prompt
    ctx.add(1, 10, False)  # a decode at context 10
    # T = 4, TC = 3*3 + 10 = 19, logits = 1 + 1: attention 2048 + 1024 + 2 * 608, ffn 6144, unembed 1024.
    assert estimate_step(shape, worker(), ctx) == (11456, 4544, 1536)
    assert (flops(4, 19, 2), read(4, 3, 3, 1, 10, 2), write(4, 2)) == (11456, 4544, 1536)


def test_tensor_parallel_splits_heads_ffn_and_vocab(tiny_dir):
    shape = ModelShape.from_checkpoint(str(tiny_dir))
    ctx = StepContext()
    ctx.add(1, 5, False)
    # tp 2: 1 head, max(1, 1 // 2) = 1 KV head, intermediate 8, vocab 16; T = 1, TC = 5, logits 1.
    # flops: qkv 2*8*3*4*2 = 384, out 2*8*4*2 = 128, qk = av = 2*5*4*2 = 80, ffn 2*8*3*8*2 = 768, unembed 2*8*16 = 256.
    # read: qkv in 32 + w 8*3*4*2*2 = 384, attn in 1*4*2*2 + 2*5*4*2*2 = 176, out in 16 + w 4*8*2*2 = 128;
    #       ffn 32 + 2*8*8*2*2 = 512 + 2*8*2*2 = 64 + 32 + 256; unembed 16 + 8*16*2 = 256.
    # write: qkv 3*4*2*2 = 48, kv 2*4*2*2 = 32, out 32; ffn 64 + 32 + 32; unembed 16*2 = 32.
    assert estimate_step(shape, worker(tp=2), ctx) == (384 + 128 + 160 + 768 + 256, 32 + 384 + 176 + 16 + 128 + 32 + 512 + 64 + 32 + 256 + 16 + 256,
                                            48 + 32 + 32 + 64 + 32 + 32 + 32)


def test_the_step_context_is_vllms_execution_context():
    kv = KVCacheManager(32, 4, 64)
    sched, worker, hasher = Scheduler(kv, 8, 64, 64), FakeWorker(32, 4, 64), BlockHasher(4)
    prefix = [2, 3, 4, 5, 6, 7, 8, 9]
    sched.add_request(Request("a", prefix, 4, seq_id=0, block_hasher=hasher))
    out = sched.schedule()
    assert StepContext.of_step(out) == StepContext(1, 8, 8, 0, 0, 64)  # a's whole prompt
    sched.update_from_output(worker.execute(out.plan))
    sched.add_request(Request("b", [*prefix, 10, 11], 4, seq_id=1, block_hasher=hasher))
    out = sched.schedule()
    # a decodes (1 token, context 9); b, new, hits a's 2 blocks and computes 2 tokens to context 10.
    assert StepContext.of_step(out) == StepContext(1, 2, 10, 1, 9, 9 + 2 * 10)


def test_a_chunk_of_a_running_prompt_is_a_prefill_and_one_token_a_decode():
    kv = KVCacheManager(32, 4, 64)
    sched, worker = Scheduler(kv, 8, 5, 64), FakeWorker(32, 4, 64)  # 5 tokens a step
    sched.add_request(Request("a", list(range(2, 14)), 2, seq_id=0, block_hasher=BlockHasher(4)))  # 12 tokens
    contexts = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        contexts.append(StepContext.of_step(out))
        sched.update_from_output(worker.execute(out.plan))
    assert contexts == [
        StepContext(1, 5, 5, 0, 0, 25),  # new
        StepContext(1, 5, 10, 0, 0, 50),  # running, 5 tokens: a prefill
        StepContext(1, 2, 12, 0, 0, 24),  # the prompt's last 2: its first token
        StepContext(0, 0, 0, 1, 13, 13),  # its second
    ]


def test_the_flags(tiny_dir, tmp_path):
    c = config_from_args(["--enable-mfu-metrics", "--model", str(tiny_dir)])
    assert c.enable_mfu_metrics and c.model == str(tiny_dir)
    # Read once, by the check: the config carries the checkpoint's shape.
    assert c.model_shape == ModelShape(2, 8, 2, 1, 4, 16, 32)
    assert not config_from_args([]).enable_mfu_metrics and config_from_args([]).model_shape is None


def test_the_element_sizes_are_the_workers(tiny_dir):
    # A float32 worker of the same checkpoint: every byte term twice the bf16 one's, flops as they were.
    shape = ModelShape.from_checkpoint(str(tiny_dir))
    ctx = StepContext()
    ctx.add(3, 3, True)
    ctx.add(1, 10, False)
    assert estimate_step(shape, worker(dtype_size=4, kv_cache_dtype_size=4), ctx) == (11456, 2 * 4544, 2 * 1536)


@pytest.mark.parametrize("argv,message", [
    (["--enable-mfu-metrics"], "--enable-mfu-metrics needs --model"),
    (["--enable-mfu-metrics", "--model", "/nonexistent"], "cannot read /nonexistent/config.json"),
    (["--enable-mfu-metrics", "--model", "MOE"], "has 'num_local_experts'"),
])
def test_bad_flags_are_named(argv, message, tmp_path, capsys):
    moe = tmp_path / "moe"
    moe.mkdir()
    (moe / "config.json").write_text(json.dumps({**TINY, "num_local_experts": 8}))
    with pytest.raises(SystemExit):
        config_from_args([str(moe) if a == "MOE" else a for a in argv])
    assert message in capsys.readouterr().err


@pytest.mark.e2e
@pytest.mark.timeout(60)
@pytest.mark.parametrize("enabled", [True, False])
def test_the_scheduler_process_counts_each_step(tiny_dir, enabled):
    s = Setup(*(["--enable-mfu-metrics", "--model", str(tiny_dir)] if enabled else []))
    try:
        s.client.generate("r", prompt_of(3, 20), 3)  # a 20-token prefill, then decodes at contexts 21 and 22
        m = s.wait_idle()
        want = (
            (flops(20, 400, 1) + flops(1, 21, 1) + flops(1, 22, 1),
             read(20, 20, 20, 0, 0, 1) + read(1, 0, 0, 1, 21, 1) + read(1, 0, 0, 1, 22, 1),
             write(20, 1) + 2 * write(1, 1))
            if enabled else (0, 0, 0)
        )
        got = tuple(metric(m, f"vllm:estimated_{what}_per_gpu_total") for what in ("flops", "read_bytes", "write_bytes"))
        assert got == want
    finally:
        s.close()


def test_an_fp8_cache_halves_the_kv_traffic_of_decodes_and_writes(tiny_dir):
    # As vLLM's cache_byte_size: a decode's context is read, and every token's K/V written,
    # at one byte; a prefill's context is counted at the activation size (b) as vLLM does.
    shape = ModelShape.from_checkpoint(str(tiny_dir))
    ctx = StepContext()
    ctx.add(3, 3, True)
    ctx.add(1, 10, False)
    # read: 2 * Nc 10 * kv 1 * d 4 * L 2 = 160 bytes at 1 instead of 2; write: 2 * T 4 * kv 1 * d 4 * L 2 = 64.
    assert estimate_step(shape, worker(kv_cache_dtype_size=1), ctx) == (11456, 4544 - 160, 1536 - 64)
    c = config_from_args(["--enable-mfu-metrics", "--model", str(tiny_dir), "--kv-cache-dtype", "fp8_e5m2"])
    assert c.kv_cache_dtype == "fp8_e5m2"
