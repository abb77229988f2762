"""The metrics row of ``make compare``: vLLM's metric families (``vllm:*``) on both servers'
``/metrics`` after the same workload, compared by what a vLLM operator's dashboards and
alerts rely on -- each family's type, its label names, the values of the labels that name
a kind (``finished_reason``, ``source``, ``reason``, ...), its histogram bucket bounds
(``le``) and the samples it exposes (``_total``, ``_created``, ``_bucket`` ...). Sample
values are not compared: the rest of the table does that.

Every difference is listed with its reason. The accepted ones have theirs in ACCEPTED,
the one place for them; any other difference fails the row.

    python -m bench.compare.metrics --vllm-url http://127.0.0.1:8000 --kvpool-url http://127.0.0.1:8001
    python -m bench.compare.metrics --vllm-file tests/deploy/data/vllm-0.32-metrics.txt --kvpool-url URL
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

PREFIX = "vllm:"
METRICS = "metrics"  # the key of the scraped pages in make compare's results
# NOTE: these labels name a deployment, not a kind: their values differ between any two
# servers not started alike (a test's served name against the reference page's).
IDENTITY_LABELS = frozenset({"model_name", "engine"})
# The vLLM families kvpool does not have, or has otherwise, on purpose: family -> reason.
# NOTE: none today: kvpool exports every family vLLM 0.32 does, alike (the live test in
# tests/bench/compare/test_metrics.py checks it, and that no reason here outlives its
# difference).
ACCEPTED: dict[str, str] = {}


@dataclass(frozen=True)
class Family:
    """What of one family a dashboard depends on."""

    type: str
    labels: tuple[str, ...]  # label names, le and quantile excepted
    values: dict[str, tuple[str, ...]]  # kind label -> its values on the page
    buckets: tuple[float, ...]  # a histogram's le bounds, +Inf included
    samples: tuple[str, ...]  # sample name suffixes: "" (a gauge), "_total", "_created", "_bucket", ...


@dataclass(frozen=True)
class Difference:
    family: str
    what: str  # "vLLM only", "kvpool only", "type", "labels", "values of LABEL", "buckets", "samples"
    vllm: str
    kvpool: str
    reason: str | None  # ACCEPTED's; None: not accepted


def is_info(name: str) -> bool:
    """An info-style gauge: value 1, its labels carry settings (values never compared)."""
    return name.endswith("_info")


def families(text: str, prefix: str = PREFIX) -> dict[str, Family]:
    """The families on an exposition page whose names start with prefix. A counter's or
    histogram's ``_created`` family (prometheus_client writes it as a gauge of its own)
    is folded into its parent as the ``_created`` sample."""
    parsed = {f.name: f for f in text_string_to_metric_families(text) if f.name.startswith(prefix)}
    created = {n for n in parsed if n.endswith("_created") and n.removesuffix("_created") in parsed}
    out = {}
    for name, fam in parsed.items():
        if name in created:
            continue
        labels: dict[str, set[str]] = {}
        buckets: set[float] = set()
        for s in fam.samples:
            for k, v in s.labels.items():
                if k == "le":
                    buckets.add(float(v))
                elif k != "quantile":
                    labels.setdefault(k, set()).add(v)
        suffixes = {s.name.removeprefix(name) for s in fam.samples} | ({"_created"} if name + "_created" in created else set())
        values = {} if is_info(name) else {k: tuple(sorted(v)) for k, v in labels.items() if k not in IDENTITY_LABELS}
        out[name] = Family(fam.type, tuple(sorted(labels)), values, tuple(sorted(buckets)), tuple(sorted(suffixes)))
    return out


def _show(xs) -> str:
    return ", ".join(f"{x:g}" if isinstance(x, float) else (x or '""') for x in xs) or "-"


def family_differences(name: str, v: Family | None, k: Family | None) -> list[tuple[str, str, str]]:
    """(what, vLLM's, kvpool's) for each way one family differs."""
    if k is None:
        return [("vLLM only", v.type, "-")]
    if v is None:
        return [("kvpool only", "-", k.type)]
    out = []
    if v.type != k.type:
        out.append(("type", v.type, k.type))
    if v.labels != k.labels:
        out.append(("labels", _show(v.labels), _show(k.labels)))
    for label in sorted(set(v.values) & set(k.values)):
        if v.values[label] != k.values[label]:
            out.append((f"values of {label}", _show(v.values[label]), _show(k.values[label])))
    if v.buckets != k.buckets:
        out.append(("buckets", _show(v.buckets), _show(k.buckets)))
    if v.samples != k.samples:
        out.append(("samples", _show(v.samples), _show(k.samples)))
    return out


def diff(vllm: dict[str, Family], kvpool: dict[str, Family], accepted: dict[str, str] = ACCEPTED) -> list[Difference]:
    """Every difference between two pages' families, in family order, with its reason."""
    return [Difference(name, what, a, b, accepted.get(name))
            for name in sorted(vllm.keys() | kvpool.keys())
            for what, a, b in family_differences(name, vllm.get(name), kvpool.get(name))]


def report(vllm_text: str, kvpool_text: str, accepted: dict[str, str] = ACCEPTED) -> dict:
    """The comparison as JSON: the families' counts, every difference, the unlisted count."""
    v, k = families(vllm_text), families(kvpool_text)
    diffs = diff(v, k, accepted)
    return {"num_vllm_families": len(v), "num_kvpool_families": len(k),
            "num_listed": sum(d.reason is not None for d in diffs), "num_unlisted": sum(d.reason is None for d in diffs),
            "differences": [asdict(d) for d in diffs]}


def metrics_row(doc: dict) -> dict:
    """The table's row: met when every difference is an accepted one."""
    unlisted = f", {doc['num_unlisted']} NOT listed" if doc["num_unlisted"] else ""
    return {"workload": METRICS, "figure": f"vllm:* families equal except {doc['num_listed']} listed{unlisted}",
            "key": "num_unlisted", "vllm": doc["num_vllm_families"], "kvpool": doc["num_kvpool_families"], "ratio": None,
            "goal": "0 unlisted", "met": doc["num_unlisted"] == 0}


def metrics_report(pages: dict[str, dict[str, str]], accepted: dict[str, str] = ACCEPTED) -> tuple[list[dict], dict]:
    """make compare's metrics row and JSON from ``{pool: {engine: page}}``: the first pool
    where both engines left a page; no row where none did."""
    for pool, got in pages.items():
        if {"vllm", "kvpool"} <= got.keys():
            doc = {"pool": pool} | report(got["vllm"], got["kvpool"], accepted)
            return [metrics_row(doc)], doc
    return [], {}


def format_differences(doc: dict) -> str:
    """The differences under the table, one a line, each with its reason or NOT LISTED."""
    if not doc.get("differences"):
        return ""
    ds = doc["differences"]
    w = max(len(d["family"]) for d in ds), max(len(d["what"]) for d in ds)
    lines = [f"\nmetrics: vllm:* family differences ({doc['num_listed']} listed, {doc['num_unlisted']} not):"]
    for d in ds:
        why = f"listed: {d['reason']}" if d["reason"] else "NOT LISTED"
        seen = "" if d["what"].endswith(" only") else f"  (vLLM: {d['vllm']}; kvpool: {d['kvpool']})"
        lines.append(f"  {d['family'].ljust(w[0])}  {d['what'].ljust(w[1])}  {why}{seen}")
    return "\n".join(lines)


def read_page(url: str | None, file: Path | None, timeout_s: float = 10.0) -> str:
    if file is not None:
        return file.read_text()
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=timeout_s) as r:
        return r.read().decode()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.compare.metrics", description=__doc__.split("\n\n")[0])
    for engine in ("vllm", "kvpool"):
        g = p.add_mutually_exclusive_group(required=True)
        g.add_argument(f"--{engine}-url", help=f"a live {engine} server (its /metrics is read)")
        g.add_argument(f"--{engine}-file", type=Path, help=f"a saved {engine} /metrics page")
    p.add_argument("--json", type=Path, default=None, help="write the comparison there too")
    a = p.parse_args(argv)
    try:
        doc = report(read_page(a.vllm_url, a.vllm_file), read_page(a.kvpool_url, a.kvpool_file))
    except (OSError, ValueError) as e:
        raise SystemExit(f"compare.metrics: {e}") from None
    row = metrics_row(doc)
    print(f"{row['figure']}: vLLM {row['vllm']} families, kvpool {row['kvpool']}" + format_differences(doc))
    if a.json:
        a.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0 if row["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
