"""vLLM's engine offline, every request queued before its first step; run by
``.venv-vllm``'s python (``bench.compare.offline`` starts it), never the project's.

    .venv-vllm/bin/python bench/compare/vllm_offline.py SPEC.json OUT.json

SPEC: {"model", "config": ServerConfig's fields, "prompts": [[token id, ...], ...],
"max_tokens"}. OUT: {"outputs": each request's generated token ids, "metrics": the
counters of the run}. The engine runs in this process (no engine-core process), so
``LLM.generate`` adds every request before the scheduler takes its first step, and
greedy decoding with ignore_eos makes every request generate exactly max_tokens.
"""

from __future__ import annotations

import json
import os
import sys

COUNTERS = ("vllm:num_preemptions", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
            "vllm:prompt_tokens", "vllm:generation_tokens")


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: vllm_offline.py SPEC.json OUT.json", file=sys.stderr)
        return 2
    spec = json.loads(open(argv[0]).read())
    # NOTE: before vllm is imported: its engine core in this process, not a child.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    c = spec["config"]
    llm = LLM(model=spec["model"], block_size=c["block_size"], num_gpu_blocks_override=c["num_blocks"],
              max_num_seqs=c["max_num_seqs"], max_num_batched_tokens=c["max_num_batched_tokens"],
              max_model_len=c["max_model_len"], dtype=c["dtype"], enable_prefix_caching=c["prefix_caching"],
              disable_log_stats=False, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]], params, use_tqdm=False)
    metrics = {m.name: m.value for m in llm.get_metrics() if m.name in COUNTERS}
    with open(argv[1], "w") as f:
        json.dump({"outputs": [list(o.outputs[0].token_ids) for o in outs], "metrics": metrics}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
