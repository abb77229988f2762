"""The scheduler process's entry point (`python -m scheduler`, `kvpool-scheduler`)."""

from __future__ import annotations

import asyncio
import logging

from scheduler.engine.args import config_from_args


def main(argv: list[str] | None = None) -> int:
    config = config_from_args(argv)
    logging.basicConfig(level=config.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from scheduler.engine.engine_core import EngineCore

    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; fall back quietly
        uvloop = None

    async def serve() -> int:
        try:
            engine = EngineCore(config)
        except Exception as e:  # a port in use, a bad address: say which and exit 1
            logging.getLogger("scheduler").error("cannot start: %s", e)
            return 1
        return await engine.run()

    if uvloop is not None:
        return uvloop.run(serve())
    return asyncio.run(serve())
