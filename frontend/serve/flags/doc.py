"""Writes docs/vllm-serve-flags.md from the table, so the page cannot drift from it
(tests/frontend/serve/test_cli_flag_table.py checks that it is current):

    python -m frontend.serve.flags.doc > docs/vllm-serve-flags.md
"""

from __future__ import annotations

from collections import Counter

from frontend.serve.flags import GROUPS, all_rules
from frontend.serve.flags.rules import HANDLED, PASSED, REFUSED, SAME, Rule, spell

HEADER = """# `vllm serve` 0.32's flags in `kvpool serve`

`kvpool serve` takes every flag of `vllm serve` (vLLM 0.32), so that a systemd unit or a
Helm chart can swap one command for the other. Each flag is one of:

* **handled**: kvpool acts on it, in the process named;
* **passed**: given to that process under the same name, as written;
* **same**: accepted; kvpool already behaves as vLLM does with it, for the reason given;
* **refused**: `kvpool serve` exits 2 before starting anything, with one line naming the
  flag and the reason (`kvpool serve: --enable-lora: LoRA adapters are not supported...`);
  the values listed as accepted are the ones where vLLM behaves as kvpool does anyway.

A flag that is neither vLLM's nor kvpool's is argparse's error, as in vLLM. Flags are
spelled as vLLM lets them be (`frontend/serve/flags/spelling.py`): underscores
(`--max_model_len`), `-O3` for `--optimization-level 3`, a JSON config one field at a
time (`--kv-events-config.topic kv`); and `--config FILE.yaml` reads flags from a YAML
file as vLLM does (the command line overrides it). kvpool's own flags are listed by
`kvpool serve --help`, in its last group.

Generated from `frontend/serve/flags/` by `python -m frontend.serve.flags.doc`; do not edit.
"""


def _answer(rule: Rule) -> str:
    if rule.verdict == HANDLED:
        limits = f"; not supported: other values ({rule.why_not})" if rule.accepts else ""
        return f"handled: {rule.note}{limits}"
    if rule.verdict == PASSED:
        return rule.note
    if rule.verdict == SAME:
        return f"same: {rule.note}"
    accepted = f" (accepted: {', '.join(f'`{spell(rule, v)}`' for v in rule.accepts)})" if rule.accepts else ""
    return f"refused: {rule.note}{accepted}"


def render() -> str:
    counts = Counter(rule.verdict for rule in all_rules())
    lines = [HEADER, f"{len(all_rules())} flags: " + ", ".join(f"{counts[v]} {v}" for v in (HANDLED, PASSED, SAME, REFUSED)) + ".", ""]
    for group in GROUPS:
        lines += [f"## {group.title}", ""]
        if group.description:
            lines += [f"vLLM: {group.description}", ""]
        lines += ["| flag | kvpool |", "| --- | --- |"]
        for rule in group.rules:
            names = ", ".join(f"`{s}`" for s in rule.option_strings)
            answer = _answer(rule).replace("|", r"\|")
            lines.append(f"| {names} | {answer} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(render(), end="")
