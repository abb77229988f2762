"""The frontend process on its own (``python -m frontend``); ``kvpool serve`` starts it for you."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from frontend.config import config_from_args

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def main(argv: list[str] | None = None) -> int:
    config = config_from_args(argv)
    logging.basicConfig(level=config.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from frontend.api_server import serve

    async def run() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_stop_signal() -> None:
            # NOTE: once: a second SIGTERM (kvpool serve's, after its process group's) must
            # not end the stop under way; left to the loop, whose close restores the
            # default action, it killed the process in its last moments (status -15).
            for sig in STOP_SIGNALS:
                loop.remove_signal_handler(sig)
                signal.signal(sig, signal.SIG_IGN)
            stop.set()

        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, on_stop_signal)
        return await serve(config, stop)

    try:
        import uvloop

        return uvloop.run(run())
    except ImportError:  # pragma: no cover
        return asyncio.run(run())


if __name__ == "__main__":
    sys.exit(main())
