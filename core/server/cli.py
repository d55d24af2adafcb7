"""`shuili serve`: the OpenAI-compatible server on uvicorn, with a graceful SIGTERM / SIGINT drain."""
from __future__ import annotations

import asyncio
import logging

log = logging.getLogger("shuili.serve")

DRAIN_POLL_S = 0.05
FLUSH_TIMEOUT_S = 5.0


def add_parser(sub) -> None:
    from shuili.core.cli import _engine_args

    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (completions, chat, metrics)")
    _engine_args(s)
    s.add_argument("--no-overlap", action="store_false", dest="overlap",
                   help="serve without overlap mode (the server turns it on by default)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    s.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    s.add_argument("--served-model-name", default=None, help="the name clients pass as `model` "
                   "(default: --model)")
    s.add_argument("--max-waiting", type=int, default=None,
                   help="answer 503 with Retry-After once this many requests wait for admission")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM/SIGINT, seconds running requests may finish before they are aborted")
    s.add_argument("--uvicorn-log-level", default="warning",
                   choices=("critical", "error", "warning", "info", "debug", "trace"),
                   help="uvicorn's own log level (shuili's requests are logged by shuili)")
    s.set_defaults(func=cmd_serve)


def _make_server(args):
    from shuili.core.cli import _config
    from shuili.core.engine import Engine
    from shuili.core.server.app import Server

    if args.max_waiting is not None and args.max_waiting < 0:
        raise ValueError(f"--max-waiting {args.max_waiting} must be >= 0")
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout {args.shutdown_timeout} must be >= 0")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    config = _config(args)
    if args.overlap is None:  # batch results are the same bits either way; overlap only saves time
        config = config.model_copy(update={"overlap": True})
    from shuili.core.parallel import engine_class

    if config.world_size > 1:  # overlap is not supported across ranks yet
        config = config.model_copy(update={"overlap": False})
    engine = engine_class(config)(config)
    return Server(engine, args.served_model_name or config.model, args.max_waiting)


def cmd_serve(args) -> int:
    import uvicorn

    from shuili.core.server.app import build_app

    srv = _make_server(args)
    config = uvicorn.Config(build_app(srv), host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                            timeout_graceful_shutdown=FLUSH_TIMEOUT_S, lifespan="on")
    server = _make_draining_server()(config, srv, args.shutdown_timeout)
    print(f"shuili serve: {srv.model_name} on http://{args.host}:{args.port} "
          f"(system_fingerprint {srv.fingerprint})", flush=True)
    server.run()
    print("shuili serve: stopped", flush=True)
    return 0


def _make_draining_server():
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """The first SIGTERM/SIGINT drains instead of stopping at once: the listening socket closes,
        new requests get 503, running ones get `shutdown_timeout` seconds and are then aborted
        (their clients get a final chunk with finish_reason "abort"). A second signal exits now.
        The signal is not re-raised after the drain, so the process exits 0."""

        def __init__(self, config, srv, shutdown_timeout: float):
            super().__init__(config)
            self.srv = srv
            self.shutdown_timeout = shutdown_timeout
            self._loop = None
            self._drain = None

        async def startup(self, sockets=None):
            self._loop = asyncio.get_running_loop()
            await super().startup(sockets)

        def handle_exit(self, sig, frame):
            if self._drain is not None or self._loop is None:
                self.force_exit = self._drain is not None
                self.should_exit = True
                return
            log.warning("signal %d: draining (up to %.0f s)", sig, self.shutdown_timeout)
            self._drain = True
            self._loop.call_soon_threadsafe(self._start_drain)

        def _start_drain(self):
            self._drain = self._loop.create_task(self.drain())

        async def drain(self):
            srv = self.srv
            srv.draining = True
            for s in getattr(self, "servers", []):
                s.close()
            await self._wait_idle(self.shutdown_timeout)
            if srv.loop.num_in_flight():
                n = await srv.loop.abort_all()
                log.warning("aborted %d running requests at shutdown", n)
                await self._wait_idle(FLUSH_TIMEOUT_S)
            self.should_exit = True

        async def _wait_idle(self, timeout: float):
            for _ in range(int(timeout / DRAIN_POLL_S) + 1):
                if not self.srv.loop.num_in_flight() or not self.srv.loop.alive:
                    return
                await asyncio.sleep(DRAIN_POLL_S)

    return DrainingServer

