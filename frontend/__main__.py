"""The frontend process on its own (``python -m frontend``); ``kvpool serve`` starts it for you."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from frontend.config import config_from_args


def main(argv: list[str] | None = None) -> int:
    config = config_from_args(argv)
    logging.basicConfig(level=config.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from frontend.api_server import serve

    async def run() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        return await serve(config, stop)

    try:
        import uvloop

        return uvloop.run(run())
    except ImportError:  # pragma: no cover
        return asyncio.run(run())


if __name__ == "__main__":
    sys.exit(main())
