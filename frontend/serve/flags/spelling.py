"""How vLLM's FlexibleArgumentParser lets a flag be spelled, read the same way:

* underscores for dashes in a flag's name: ``--max_model_len`` is ``--max-model-len``;
* ``-O3``, ``-O=3`` and ``-O 3`` for ``--optimization-level 3``;
* a JSON config flag one field at a time: ``--kv-events-config.topic kv`` (and
  ``--X.a.b 1`` nested), every field of one flag merged into one JSON object, given
  as ``--X JSON`` after the rest (so it wins over an ``--X JSON`` written out); a value
  is read as JSON, else as a human-readable integer (``80k``), else as text, and
  ``--X.list+ a,b`` is the list ``["a", "b"]``.
"""

from __future__ import annotations

import json
import re
from argparse import ArgumentTypeError

from frontend.serve.flags.values import human_readable_int

# Everything between the leading -- and the first "." or "=" (vLLM's pattern).
_NAME = re.compile(r"(?<=^--)[^.=]*")


def _dashed(arg: str) -> str:
    return _NAME.sub(lambda m: m.group(0).replace("_", "-"), arg, count=1)


def normalize_flag_names(argv: list[str]) -> list[str]:
    """vLLM's spellings of ``argv`` as plain flags (see the module docstring)."""
    out: list[str] = []
    for i, arg in enumerate(argv):
        if arg.startswith("--") and " " not in arg:
            out.append(_dashed(arg))
        elif arg.startswith("-O") and arg != "-O":
            out += ["--optimization-level", arg[3:] if arg[2:3] == "=" else arg[2:]]
        elif arg == "-O" and i + 1 < len(argv) and argv[i + 1] in ("0", "1", "2", "3"):
            out.append("--optimization-level")
        else:
            out.append(arg)
    return _merge_dotted(out)


def _value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        try:
            return human_readable_int(text)
        except (ValueError, ArgumentTypeError):
            return text


def _update(into: dict, update: dict) -> None:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _update(into[key], value)
        elif isinstance(value, list) and isinstance(into.get(key), list):
            into[key] += value
        else:
            into[key] = value


def _merge_dotted(argv: list[str]) -> list[str]:
    merged: dict[str, dict] = {}
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, text = arg.partition("=")
        if not (arg.startswith("--") and "." in name):
            out.append(arg)
            i += 1
            continue
        if not eq:
            if i + 1 == len(argv):
                out.append(arg)  # argparse names the missing value
                break
            text, i = argv[i + 1], i + 1
        i += 1
        value = _value(text)
        if name.endswith("+"):
            name, value = name[:-1], text.split(",")
        flag, *keys = name.split(".")
        for key in reversed(keys):
            value = {key: value}
        _update(merged.setdefault(flag, {}), value)
    for flag, value in merged.items():
        out += [flag, json.dumps(value)]
    return out
