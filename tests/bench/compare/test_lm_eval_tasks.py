"""lm-evaluation-harness (``local-completions``) against a live `kvpool serve`: a
multiple-choice task scored by loglikelihood through echo + logprobs, and a generation
task. Each choice's loglikelihood must be transformers' on the same checkpoint, the
tokens split as the harness splits them. Marked ``compare``: the same run against
vLLM itself, per-choice loglikelihoods equal within 1e-3 (float32)."""

from __future__ import annotations

import json
import math

import pytest

from bench.compare.lm_eval_tasks import (
    GEN_DOCS,
    MC_DOCS,
    MC_TASK,
    max_difference,
    samples,
    write_tasks,
)

pytest.importorskip("lm_eval")
pytest.importorskip("tenacity")  # lm_eval's API models need it (lm-eval[api])
torch = pytest.importorskip("torch")


def test_tasks_are_written_with_absolute_data_paths(tmp_path):
    d = write_tasks(tmp_path / "t")
    config = json.loads((d / f"{MC_TASK}.yaml").read_text())
    data = config["dataset_kwargs"]["data_files"]["test"]
    assert data.startswith("/") and [json.loads(x) for x in open(data)] == MC_DOCS
    assert config["output_type"] == "multiple_choice" and config["dataset_path"] == "json"


def test_max_difference_pairs_every_choice():
    a = {"mc": [[-1.0, -2.0], [-3.0]], "gen": []}
    assert max_difference(a, {"mc": [[-1.0, -2.5], [-3.0001]], "gen": []}) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        max_difference(a, {"mc": [[-1.0], [-3.0]], "gen": []})


def reference_loglikelihoods(tiny_checkpoint) -> list[list[float]]:
    """Per document, per choice: the harness's split (context "Q: ...\\nA:", continuation
    " " + choice; the whole encoded, the context's tokens cut off) scored by transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_checkpoint))
    m = AutoModelForCausalLM.from_pretrained(str(tiny_checkpoint), dtype=torch.float32).eval()
    out = []
    for doc in MC_DOCS:
        context = f"Q: {doc['question']}\nA:"
        ctx = tok(context, add_special_tokens=False).input_ids
        row = []
        for choice in doc["choices"]:
            whole = tok(context + " " + choice, add_special_tokens=False).input_ids
            with torch.no_grad():
                lp = m(torch.tensor([whole])).logits[0, :-1].float().log_softmax(dim=-1)  # (len - 1, V)
            cont = torch.tensor(whole[len(ctx) :])
            row.append(lp[len(ctx) - 1 :].gather(1, cont[:, None]).sum().item())
        out.append(row)
    return out


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_lm_eval_scores_choices_as_transformers(tiny_checkpoint, tmp_path):
    from kvtest.serve import kvpool_serve

    with kvpool_serve(tiny_checkpoint, tmp_path / "logs", "--dtype", "float32") as s:
        got = samples(s.base_url, str(tiny_checkpoint), str(tiny_checkpoint), tmp_path / "lm-eval", timeout=400)
    want = reference_loglikelihoods(tiny_checkpoint)
    assert all(math.isfinite(x) and x < 0 for row in got["mc"] for x in row)
    assert [x for row in got["mc"] for x in row] == pytest.approx([x for row in want for x in row], abs=1e-3)
    assert len(got["gen"]) == len(GEN_DOCS) and all(isinstance(t, str) and t for t in got["gen"])


@pytest.mark.compare
@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(1200)
def test_lm_eval_loglikelihoods_equal_vllms(real_vllm, tiny_checkpoint, tmp_path):
    from bench.compare.servers import Server, ServerConfig, free_port, server_command, vllm_env

    cfg = ServerConfig(num_blocks=128)
    got = {}
    for engine in ("vllm", "kvpool"):
        port = free_port()
        env = {"OMP_NUM_THREADS": "1"} | (vllm_env(tmp_path / "cache", cfg, tiny_checkpoint, 1) if engine == "vllm" else {})
        cmd = server_command(engine, tiny_checkpoint, port, cfg, real_vllm, "tiny")
        with Server(engine, cmd, env, tmp_path / f"{engine}.log", port) as s:
            s.wait_ready(600)
            got[engine] = samples(s.url, "tiny", str(tiny_checkpoint), tmp_path / engine, timeout=400)
    assert max_difference(got["vllm"], got["kvpool"]) <= 1e-3


def test_compare_rows_judge_the_largest_difference():
    from bench.compare.lm_eval_tasks import lm_eval_rows
    from bench.compare.report import format_table

    v = {"mc": [[-1.0, -2.0]], "gen": ["a", "b"]}
    diff, same = lm_eval_rows({"vllm": v, "kvpool": {"mc": [[-1.0, -2.002]], "gen": ["a", "c"]}})
    assert diff["kvpool"] == pytest.approx(0.002) and diff["met"] is False
    assert same["kvpool"] == 0.5
    assert lm_eval_rows({"vllm": v, "kvpool": {"mc": [[-1.00001, -2.0]], "gen": ["a", "b"]}})[0]["met"] is True
    # An engine that failed: no figure, no verdict.
    assert lm_eval_rows({"vllm": v, "kvpool": {"error": "down"}})[0]["met"] is None
    assert "2.0e-03" in format_table([diff])
