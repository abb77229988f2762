"""Arctic Inference's suffix-decoding drafts on seeded random serving runs, as JSON: what
tests/scheduler/spec/test_suffix_vs_arctic.py checks kvpool's SuffixProposer against.

Run with a python that has ``arctic-inference==0.3.0`` (vLLM 0.32's suffix decoding calls it;
it is not one of kvpool's dependencies):

    python tests/scheduler/spec/make_suffix_drafts.py 0 40 > tests/scheduler/spec/data/arctic_suffix_drafts.json

Each run is a few requests over small vocabularies (so suffixes repeat, within a request and
across them), each step a batch of some of them, each sampling 1 to 4 verified tokens; some are
left out of a step or preempted (vLLM's runner then stops them in the cache), some end, some
request ids come back. The cache is driven as vLLM 0.32's ``SuffixDecodingProposer.propose``
drives it: a request not active starts (evicting its id's cached response), its sampled tokens
go in, then it drafts from its last max_tree_depth tokens; requests not in the batch stop.
"""

from __future__ import annotations

import json
import random
import sys


def make_run(seed: int) -> dict:
    """A run's settings and steps: each step's batch, [request id, new prompt or None, sampled tokens, last step?]."""
    rng = random.Random(seed)
    depth = rng.choice((2, 4, 8, 24))
    config = {
        "num_speculative_tokens": rng.choice((1, 3, 5, depth)),
        "max_tree_depth": depth,
        "max_cached_requests": rng.choice((0, 1, 2, 4, 10000)),
        "max_spec_factor": rng.choice((0.3, 0.5, 1.0, 1.5, 2.0)),
        "min_token_prob": rng.choice((0.0, 0.1, 0.25, 0.5)),
        "max_model_len": rng.choice((24, 48, 200)),
    }
    vocab = rng.choice((3, 5, 8))
    motifs = [[rng.randrange(vocab) for _ in range(rng.randrange(2, 7))] for _ in range(3)]

    def text(n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            out += rng.choice(motifs) if rng.random() < 0.7 else [rng.randrange(vocab)]
        return out[:n]

    lengths: dict[str, int] = {}  # running (or stopped) request id -> its number of tokens
    ended: list[str] = []  # ids free again
    # NOTE: vLLM's runner stops an ended request in the cache at the end of the next step, so
    # an id is reused two steps after its request's last at the earliest.
    ending: list[list[str]] = [[], []]
    steps, next_id = [], 0
    for _ in range(rng.randrange(20, 60)):
        ended += ending.pop(0)
        ending.append([])
        while len(lengths) < 4 and rng.random() < 0.5:
            reuse = ended and rng.random() < 0.2
            request_id = ended.pop(rng.randrange(len(ended))) if reuse else f"r{next_id}"
            next_id += not reuse
            lengths[request_id] = -rng.randrange(2, 16)  # negative: its prompt's length, not yet sent
        batch = []
        for request_id, num_tokens in list(lengths.items()):
            if rng.random() < 0.15:
                continue  # left out of this step, or preempted: vLLM's runner stops it
            prompt = None
            if num_tokens < 0:
                prompt, num_tokens = text(-num_tokens), -num_tokens
            sampled = text(min(rng.randrange(1, 5), config["max_model_len"] - num_tokens))
            num_tokens += len(sampled)
            last = num_tokens >= config["max_model_len"] or rng.random() < 0.05
            batch.append([request_id, prompt, sampled, last])
            lengths[request_id] = num_tokens
            if last:
                del lengths[request_id]
                ending[-1].append(request_id)
        steps.append(batch)
    return {"seed": seed, "config": config, "steps": steps}


def arctic_drafts(run: dict) -> list[list[list[int]]]:
    """Each step's drafts, in batch order, from Arctic's cache driven as vLLM's runner drives it."""
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    c = run["config"]
    depth, max_model_len = c["max_tree_depth"], c["max_model_len"]
    cache = SuffixDecodingCache(max_tree_depth=depth, max_cached_requests=c["max_cached_requests"])
    tokens: dict[str, list[int]] = {}
    prompts: dict[str, list[int]] = {}
    out = []
    for batch in run["steps"]:
        drafts = []
        for request_id, prompt, sampled, _ in batch:
            if prompt is not None:
                prompts[request_id], tokens[request_id] = prompt, list(prompt)
            tokens[request_id] += sampled
            num_tokens = len(tokens[request_id])
            if num_tokens >= max_model_len:
                drafts.append([])
                continue
            if request_id not in cache.active_requests:
                if request_id in cache.cached_requests:
                    cache.evict_cached_response(request_id)
                cache.start_request(request_id, prompts[request_id])
            cache.add_active_response(request_id, sampled)
            pattern = tokens[request_id][max(0, num_tokens - depth):]
            draft = cache.speculate(request_id, pattern, max_spec_tokens=min(c["num_speculative_tokens"], max_model_len - num_tokens - 1),
                                    max_spec_factor=c["max_spec_factor"], min_token_prob=c["min_token_prob"])
            drafts.append(list(draft.token_ids))
        in_batch = {entry[0] for entry in batch}
        for request_id in list(cache.active_requests - in_batch):
            cache.stop_request(request_id)
        out.append(drafts)
    return out


def main(first_seed: int, num_runs: int) -> None:
    runs = []
    for seed in range(first_seed, first_seed + num_runs):
        run = make_run(seed)
        run["drafts"] = arctic_drafts(run)
        runs.append(run)
    json.dump({"arctic_inference": "0.3.0", "runs": runs}, sys.stdout, separators=(",", ":"))
    sys.stdout.write("\n")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
