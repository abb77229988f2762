"""Greedy tokens and their logprobs from vLLM itself, offline; run by ``.venv-vllm``'s
python (a ``compare`` test starts it), never the project's.

    .venv-vllm/bin/python tests/kvtest/vllm_greedy.py SPEC.json OUT.json

SPEC: {"model", "prompts": [[token id, ...], ...], "max_tokens", "block_size"}; the
checkpoint needs no tokenizer. OUT: {"outputs": each request's token ids, "logprobs":
each one's logprob of every token it chose}. float32, prefix caching on (vLLM's default).
"""

from __future__ import annotations

import json
import os
import sys


def main(argv: list[str]) -> int:
    spec = json.loads(open(argv[0]).read())
    # NOTE: before vllm is imported: its engine core in this process, not a child.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=spec["model"], dtype="float32", skip_tokenizer_init=True, max_model_len=512,
              block_size=spec["block_size"], enforce_eager=True, max_num_seqs=8, seed=0)
    params = SamplingParams(
        temperature=0.0,
        max_tokens=spec["max_tokens"],
        ignore_eos=True,
        detokenize=False,
        logprobs=0,
    )
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]], params, use_tqdm=False
    )
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [
        [d[t].logprob for d, t in zip(o.outputs[0].logprobs, ts, strict=True)]
        for o, ts in zip(outs, tokens, strict=True)
    ]
    with open(argv[1], "w") as f:
        json.dump({"outputs": tokens, "logprobs": logprobs}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
