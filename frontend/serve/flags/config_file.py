"""``--config FILE.yaml``, as vLLM's FlexibleArgumentParser reads it.

* The file's keys are flags without their ``--`` (dashes or underscores); a value
  ``true`` is the bare flag, ``false`` its ``--no-`` form where there is one (else
  nothing), a list the flag and its items, a mapping the flag and its JSON, anything
  else the flag and the value as text. ``model: DIR`` is ``--model DIR``.
* The file's flags go right after ``serve`` (and the positional MODEL), before the
  command line's, so the command line wins: cli > file > defaults.
"""

from __future__ import annotations

import json

import yaml

from frontend.serve.flags.spelling import normalize_flag_names


class ConfigFileError(ValueError):
    """A --config file that cannot be read as flags; the message names the file and why."""


def config_flags(path: str, option_strings: set[str]) -> list[str]:
    """The flags of the YAML file at ``path``, in the file's order."""
    if path.rsplit(".", 1)[-1] not in ("yaml", "yml"):
        raise ConfigFileError(f"--config {path}: the file must be YAML (.yaml or .yml)")
    try:
        with open(path) as f:
            config = yaml.safe_load(f)
    except OSError as e:
        raise ConfigFileError(f"--config {path}: cannot be read ({e.strerror})") from None
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where is not None else ""
        raise ConfigFileError(f"--config {path} is not valid YAML{at}: {getattr(e, 'problem', None) or e}") from None
    if config is None:
        return []
    if not isinstance(config, dict):
        raise ConfigFileError(f"--config {path}: expected a mapping of flag: value, got a {type(config).__name__}")
    flags: list[str] = []
    for key, value in config.items():
        flag = "--" + str(key).replace("_", "-")
        if isinstance(value, bool):
            no_flag = "--no-" + flag[2:]
            flags += [flag] if value else [no_flag] if no_flag in option_strings else []
        elif isinstance(value, list):
            flags += [flag, *map(str, value)] if value else []
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags


def with_config_file(argv: list[str], serve_parser) -> list[str]:
    """``argv`` (``serve ...``) with its ``--config FILE`` replaced by the file's flags."""
    spots = [i for i, arg in enumerate(argv) if arg == "--config" or arg.startswith("--config=")]
    if not spots or not argv or argv[0] != "serve":
        return argv
    if len(spots) > 1:
        raise ConfigFileError("--config is given more than once; give one file")
    i = spots[0]
    if argv[i] == "--config":
        if i + 1 == len(argv):
            raise ConfigFileError("--config needs a file: --config FILE.yaml")
        path, rest = argv[i + 1], argv[i + 2 :]
    else:
        path, rest = argv[i].removeprefix("--config="), argv[i + 1 :]
    flags = normalize_flag_names(config_flags(path, set(serve_parser._option_string_actions)))
    head = 2 if len(argv) > 1 and not argv[1].startswith("-") and i > 1 else 1
    return argv[:head] + flags + argv[head:i] + rest
