"""`python -m kvpark.pod` / `kvpark-server`: serve a model over HTTP."""

from __future__ import annotations

import logging
import sys

import uvicorn

from .api import create_app
from .args import parse_args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kvpark").info("%r", args)
    app = create_app(args)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=int(args.shutdown_timeout))
    server = uvicorn.Server(config)

    def exit_on_load_failure() -> None:
        server.should_exit = True

    app.state.server.on_load_failed = exit_on_load_failure
    server.run()
    return 1 if app.state.server.loading_error else 0


if __name__ == "__main__":
    sys.exit(main())
