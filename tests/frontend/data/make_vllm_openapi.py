"""Writes frontend/routes/vllm_openapi_0.32.json: vLLM 0.32's own OpenAPI schema and docs pages,
cut to the routes kvpool's API server has. Run once by hand with the project's
interpreter, vLLM 0.32 installed in .venv-vllm (``bash bench/install_vllm.sh``):

    .venv/bin/python tests/frontend/data/make_vllm_openapi.py

It runs itself again under .venv-vllm's python (``--vllm``), where vLLM's FastAPI app
is built as ``vllm serve`` builds it (``build_app`` with the "generate" task) with every
optional route of kvpool's on (``VLLM_SERVER_DEV_MODE``, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``,
``--enable-tokenizer-info-endpoint``, ``--enable-scale-out``), and prints what its
``/openapi.json``, ``/docs``, ``/docs/oauth2-redirect`` and ``/redoc`` answer (under the
root path ``{root_path}``, which the API server fills in). Back here, kvpool's app is
built with the same routes on and only the (path, method) pairs it registers are kept,
with the component schemas they reference. Nothing of vLLM's is edited.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
PAGES = ("/docs", "/docs/oauth2-redirect", "/redoc")


def vllm_answers(root_path: str) -> dict:
    """In .venv-vllm: vLLM's schema and pages, as its app serves them under ``root_path``."""
    warnings.filterwarnings("ignore")
    os.environ.update(VLLM_TARGET_DEVICE="cpu", VLLM_SERVER_DEV_MODE="1", VLLM_ALLOW_RUNTIME_LORA_UPDATING="1")
    import vllm
    from fastapi.testclient import TestClient
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    assert vllm.__version__.startswith("0.32"), vllm.__version__
    flags = ["--enable-tokenizer-info-endpoint", "--enable-scale-out", "--root-path", root_path]
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(flags)
    client = TestClient(build_app(args, ("generate",)))
    schema = client.get("/openapi.json").json()
    schema.pop("servers")  # [{"url": root path}]: the API server adds it when it has one
    pages = {}
    for path in PAGES:
        r = client.get(path)
        assert r.status_code == 200, (path, r.status_code)
        pages[path] = r.text
    return {"schema": schema, "pages": pages}


def kvpool_routes() -> set[tuple[str, str]]:
    """(path, method) of every route kvpool's app registers with every optional route on."""
    from frontend.api_server import APIServer
    from frontend.config import FrontendConfig
    from worker.tiny.generate import default_checkpoint

    config = FrontendConfig(str(default_checkpoint()), "tiny", dev_mode=True, allow_runtime_lora_updating=True,
                            enable_tokenizer_info_endpoint=True, disable_fastapi_docs=True)
    app = APIServer(config).build_app()
    return {(r.resource.canonical, r.method.lower()) for r in app.router.routes()}


def main() -> None:
    if sys.argv[1:2] == ["--vllm"]:
        json.dump(vllm_answers(sys.argv[2]), sys.stdout)
        return
    sys.path.insert(0, str(REPO))
    from frontend.routes.openapi import DATA, METHODS, ROOT_PATH, cut

    env = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}
    got = subprocess.run([str(VLLM_PYTHON), __file__, "--vllm", ROOT_PATH], capture_output=True, text=True, check=True, env=env)
    vllm = json.loads(got.stdout)
    routes = kvpool_routes()
    schema = cut(vllm["schema"], routes)
    kept = {(p, m) for p, item in schema["paths"].items() for m in item if m in METHODS}
    DATA.write_text(json.dumps({"schema": schema, "pages": vllm["pages"]}, indent=1) + "\n")
    print(f"wrote {DATA.relative_to(REPO)}: {len(kept)} operations on {len(schema['paths'])} paths, "
          f"{len(schema.get('components', {}).get('schemas', {}))} component schemas")
    for path, method in sorted(routes - kept):
        print(f"  kvpool's {method.upper()} {path}: not in vLLM 0.32's schema")


if __name__ == "__main__":
    main()
