"""``vllm serve``'s ModelConfig, LoadConfig, AttentionConfig, MambaConfig and
StructuredOutputsConfig groups: the model, its weights and how it runs."""

from __future__ import annotations

from frontend.serve.flags import reasons as why
from frontend.serve.flags.rules import (
    BOOL,
    MANY,
    ONE,
    OPTIONAL,
    Group,
    declared,
    handled,
    passed,
    refused,
    same,
)
from protocol.serve_flags.model import (
    DISABLE_SLIDING_WINDOW,
    DTYPE,
    GENERATION_CONFIG,
    MAX_MODEL_LEN,
    MODEL,
    SEED,
    SERVED_MODEL_NAME,
)

_MODEL = [
    refused("--allow-deprecated-quantization", BOOL, why.QUANTIZATION, accepts=(False,)),
    refused("--allowed-local-media-path", ONE, why.MULTIMODAL),
    refused("--allowed-media-domains", MANY, why.MULTIMODAL),
    refused("--code-revision", ONE, why.LOCAL),
    refused("--config-format", ONE, "kvpool reads a Hugging Face config.json", accepts=("auto", "hf")),
    refused("--convert", ONE, why.POOLING, accepts=("auto", "none")),
    refused("--disable-cascade-attn", BOOL, "kvpool never uses cascade attention", accepts=(True,)),
    declared(DISABLE_SLIDING_WINDOW, BOOL, "launcher and worker: as vLLM, every layer attends to the whole context "
             "and --max-model-len is capped at the model's window"),
    declared(DTYPE, ONE, "worker, and the scheduler's MFU estimates (half as float16, float as float32)"),
    refused("--enable-cumem-allocator", BOOL, why.SLEEP, accepts=(False,)),
    refused("--enable-nccl-comm-suspend", BOOL, why.SLEEP, accepts=(False,)),
    refused("--enable-prompt-embeds", BOOL, why.NOT_YET, accepts=(False,)),
    refused("--enable-return-routed-experts", BOOL, why.EXPERTS, accepts=(False,)),
    refused("--enable-sleep-mode", BOOL, why.SLEEP, accepts=(False,)),
    refused("--enable-trace-replay", BOOL, why.NOT_YET, accepts=(False,)),
    refused("--enforce-eager", BOOL, why.GRAPHS, accepts=(True,)),
    declared(GENERATION_CONFIG, ONE, "frontend"),
    refused("--hf-config-path", ONE, why.LOCAL),
    refused("--hf-overrides", ONE, "overriding the checkpoint's config.json is not supported", accepts=("{}",)),
    same("--hf-token", OPTIONAL, "kvpool serves a local folder, which vLLM reads without the token too"),
    refused("--io-processor-plugin", ONE, why.POOLING),
    refused("--logits-processors", MANY, "custom logits processors are not supported"),
    refused("--logprobs-mode", ONE, "kvpool's logprobs are the raw model's (vLLM's default raw_logprobs)", accepts=("raw_logprobs",)),
    passed("--max-logprobs", ONE, "frontend"),
    declared(MAX_MODEL_LEN, ONE, "scheduler, worker and frontend (not given, or -1/auto: the model's, at most 4096, where vLLM takes it whole)"),
    declared(MODEL, ONE, "launcher (as the positional MODEL)", dest="model_flag"),
    refused("--model-class-overrides", ONE, "kvpool's worker has its own model classes", accepts=("{}",)),
    refused("--model-impl", ONE, "kvpool's worker has its own model implementation", accepts=("auto",)),
    passed("--override-generation-config", ONE, "frontend"),
    refused("--pooler-config", ONE, why.POOLING),
    refused("--quantization -q", ONE, why.QUANTIZATION, accepts=("None",)),
    refused("--quantization-config", ONE, why.QUANTIZATION),
    refused("--renderer-num-workers", ONE, "kvpool's frontend renders prompts in its one process", accepts=("1",)),
    refused("--return-sampling-mask", BOOL, why.NOT_YET, accepts=(False,)),
    refused("--revision", ONE, why.LOCAL),
    refused("--runner", ONE, why.POOLING, accepts=("auto", "generate")),
    declared(SEED, ONE, "worker"),
    declared(SERVED_MODEL_NAME, MANY, "scheduler, worker and frontend"),
    refused("--skip-tokenizer-init", BOOL, why.NOT_YET, accepts=(False,)),
    refused("--sleep-mode-offload-cudagraph", BOOL, why.SLEEP, accepts=(False,)),
    refused("--sleep-preserve-parameter-names", MANY, why.SLEEP),
    handled("--tokenizer", ONE, "launcher: MODEL's own folder, or any tokenizer folder for a GGUF MODEL", default=None,
            why_not="a tokenizer from another folder is not supported yet (kvpool reads MODEL's tokenizer.json)",
            help="accepted when it names MODEL's folder (kvpool reads MODEL's tokenizer); for a GGUF MODEL, the tokenizer "
                 "folder to use instead of the file's own"),
    refused("--tokenizer-mode", ONE, "kvpool's frontend loads transformers' AutoTokenizer, as vLLM's hf mode", accepts=("auto", "hf")),
    refused("--tokenizer-revision", ONE, why.LOCAL),
    same("--trust-remote-code", BOOL, "kvpool never runs code from a checkpoint; a model that needs its own code fails at load either way"),
    refused("--use-fp64-gumbel", BOOL, why.NOT_YET, accepts=(False,)),
]

_LOAD = [
    same("--download-dir", ONE, "kvpool serves a local folder, for which vLLM downloads nothing either"),
    refused("--ignore-patterns", MANY, why.LOADER),
    refused("--load-format", ONE, why.LOADER, accepts=("auto", "safetensors")),
    refused("--model-loader-extra-config", ONE, why.LOADER, accepts=("{}",)),
    same("--pt-load-map-location", ONE, "kvpool loads safetensors only, never a pickled .pt, so there is nothing to map"),
    refused("--safetensors-load-strategy", ONE, why.LOADER),
    refused("--safetensors-prefetch-block-size", ONE, why.LOADER),
    refused("--safetensors-prefetch-num-threads", ONE, why.LOADER),
    refused("--use-tqdm-on-load", BOOL, "kvpool shows no progress bar while loading", accepts=(False,)),
]

GROUPS = [
    Group("ModelConfig", "Configuration for the model.", _MODEL),
    Group("LoadConfig", "Configuration for loading the model weights.", _LOAD),
    Group("AttentionConfig", "Configuration for attention mechanisms in vLLM.", [refused("--attention-backend", ONE, why.KERNELS)]),
    Group("MambaConfig", "Configuration for Mamba SSM backends.", [
        refused("--enable-mamba-cache-stochastic-rounding", BOOL, why.MAMBA, accepts=(False,)),
        refused("--mamba-backend", ONE, why.MAMBA),
        refused("--mamba-cache-philox-rounds", ONE, why.MAMBA, accepts=("0",)),
        refused("--mamba-ssu-algorithm", ONE, why.MAMBA),
    ]),
    Group("StructuredOutputsConfig", "Dataclass which contains structured outputs config for the engine.", [
        refused("--reasoning-parser", ONE, why.REASONING),
        refused("--reasoning-parser-plugin", ONE, why.REASONING),
    ]),
]
