"""Why ``kvpool serve`` refuses a ``vllm serve`` flag: the reasons several flags share,
phrased for the operator who reads them in a failed start-up."""

ONE_ENGINE = (
    "a kvpool serve is one engine on one host; for more, run several kvpool serve replicas "
    "behind vllm-router (deploy/run-router.sh)"
)
# NOTE: vLLM 0.32 with --data-parallel-size 1 takes its rank from VLLM_DP_RANK (0), whatever
# --data-parallel-rank says, and tells dense models to run independent instances without
# --data-parallel-* flags; its KV events then carry rank 0 (vllm/config/parallel.py).
DP_RANK = (
    "a kvpool serve is one engine, data-parallel size 1, whose rank is 0 as vLLM's is then; independent "
    "replicas all keep rank 0 (tell them apart by --kv-events-topic)"
)
EXPERTS = "kvpool serves dense models, without expert parallelism or MoE kernels"
CONTEXT_PARALLEL = "context parallelism is not supported (kvpool splits a model only by --tensor-parallel-size)"
PIPELINE = "pipeline parallelism is not supported (kvpool splits a model only by --tensor-parallel-size)"
KERNELS = "kvpool's worker runs its own PyTorch model code, without vLLM's kernel backends"
GRAPHS = "kvpool never compiles the model or captures CUDA graphs: its worker always runs eagerly"
LORA = "LoRA adapters are not supported: kvpool serves the base model only"
MULTIMODAL = "kvpool serves text-only models: multimodal inputs are not supported"
MAMBA = "kvpool's KV cache serves full-attention models only (no Mamba/SSM state)"
SPECULATIVE = "per-request speculative decoding metrics are not supported yet (the vllm:spec_decode_* counters are)"
REASONING = "reasoning parsers are not supported yet"
QUANTIZATION = "quantized checkpoints are not supported: kvpool loads unquantized safetensors weights"
LOCAL = "kvpool serves a local checkpoint folder and downloads nothing from the Hugging Face Hub"
POOLING = "kvpool serves text generation only (no pooling, embedding or scoring runner)"
SLEEP = "sleep mode is not supported"
NOT_YET = "not supported yet"
GRPC = "kvpool serves HTTP only, no gRPC server"
TRACING = "OpenTelemetry tracing and profiling are not supported"
LOADER = "kvpool's worker loads safetensors weights its own way; vLLM's loader options do not apply"
WEIGHT_OFFLOAD = (
    "offloading model weights to host memory is not supported (kvpool's --kv-offloading-size offloads KV blocks)"
)
ASYNC = "kvpool's scheduler plans a step once the previous step's tokens are back (no async scheduling)"
UVICORN = "kvpool's HTTP server is aiohttp, not uvicorn/h11 (its request size limit is --max-request-body-bytes)"
