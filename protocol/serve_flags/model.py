"""The settings table's rows of vLLM's ModelConfig: which checkpoint, under which name,
how long a sequence, in which dtype."""

from __future__ import annotations

import argparse

from protocol.serve_flags.flag import FRONTEND, SCHEDULER, WORKER, flag
from protocol.serve_flags.values import DTYPES, dtype, human_readable_int_or_auto, seed

# --max-model-len when neither given nor known from the checkpoint: the scheduler's and the
# API server's default, and kvpool serve's cap on the model's own length.
DEFAULT_MAX_MODEL_LEN = 4096

MODEL = flag("--model", SCHEDULER, WORKER, FRONTEND, default=None, metavar="DIR",
             help="the checkpoint folder: config.json, *.safetensors, the tokenizer's files (default: none; a worker "
                  "started alone serves a tiny generated Llama)")
SERVED_MODEL_NAME = flag("--served-model-name", SCHEDULER, WORKER, FRONTEND, default=None, nargs="+", metavar="NAME",
                         why_not="kvpool serves one model name",
                         help="the model's name in the API and the model_name label of every metric (default: MODEL as "
                              "given); one name")
MAX_MODEL_LEN = flag("--max-model-len", SCHEDULER, WORKER, FRONTEND, type=human_readable_int_or_auto, default=None,
                     help="longest prompt + output, in tokens: 4096, 4k, 4K; -1 or auto: the model's (default: the model's; "
                          "kvpool serve caps it at 4096)")
DTYPE = flag("--dtype", SCHEDULER, WORKER, type=dtype, default="auto", choices=DTYPES,
             help="weights' and KV cache's dtype (half: float16, float: float32); auto: the checkpoint's torch_dtype "
                  "(default %(default)s)")
SEED = flag("--seed", WORKER, type=seed, default=0,
            help="global sampling seed: requests without a seed of their own draw from it, so they repeat across runs "
                 "given the same requests in the same order (default %(default)s, as vLLM v1)")
DISABLE_SLIDING_WINDOW = flag("--disable-sliding-window", WORKER, action=argparse.BooleanOptionalAction, default=False,
                              help="every layer full attention, --max-model-len capped at the model's sliding window, as "
                                   "vLLM (default: off; a sliding-window model is served past its window, its layers "
                                   "attending within it)")
GENERATION_CONFIG = flag("--generation-config", FRONTEND, default="auto",
                         help='"auto" (the model\'s generation_config.json), "vllm" (none) or a folder (default %(default)s)')

ROWS = (MODEL, SERVED_MODEL_NAME, MAX_MODEL_LEN, DTYPE, SEED, DISABLE_SLIDING_WINDOW, GENERATION_CONFIG)


def one_name(names: list[str] | None) -> str | None:
    """--served-model-name's one name (kvpool serves one; vLLM's flag takes several)."""
    return names[0] if names else None
