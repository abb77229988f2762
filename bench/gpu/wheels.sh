#!/usr/bin/env bash
# The Python packages kvpool needs that a CUDA host's image may lack (Python 3.12, torch,
# Triton, transformers and the rest already there), downloaded here as cp312 manylinux wheels
# into WHEELS (default .whl/, ignored by git), to travel beside the tree. On the host:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   PYTHONPATH=/tmp/site:$PWD python3 -m bench.gpu --out DIR
# Versions are this machine's (make install's), so both sides run the same ones.
set -euo pipefail
cd "$(dirname "$0")/../.."
WHEELS=${WHEELS:-.whl}
PYTHON_VERSION=${PYTHON_VERSION:-3.12}  # the host's Python (cp312 wheels)
PY=${PY:-.venv/bin/python}
mkdir -p "$WHEELS"
# xgrammar's own needs (pydantic and its parts, apache-tvm-ffi) come too; --no-deps takes none.
PACKAGES="msgspec pyzmq cbor2 partial-json-parser xgrammar apache-tvm-ffi pydantic pydantic-core annotated-types typing-inspection"
for name in $PACKAGES; do
    version=$("$PY" -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p')
    spec=$name${version:+==$version}
    platforms=""
    for n in 2_17 2_24 2_27 2_28 2_31 2_34 2_35; do platforms="$platforms --platform manylinux_${n}_x86_64"; done
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" --implementation cp \
        $platforms --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d "$WHEELS" "$spec"
done
ls -1 "$WHEELS"
du -sh "$WHEELS"
