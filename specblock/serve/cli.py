"""``python -m specblock.serve``: load the target, drafter and engine once, then serve OpenAI's API.

The decoding flags are the runtime CLI's own parser and RunConfig (one definition of every flag);
this adds only where to listen and how much to queue. Bad flags exit 2 with one line. SIGTERM
drains the server (uvicorn stops accepting, finishes or after --shutdown-timeout cancels what is
in flight) and the process exits 0.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from specblock import gcstart
from specblock.errors import SpecBlockError
from specblock.models import DEFAULT_TARGET_NAME, MODELS
from specblock.runtime.cli import Session, build_parser as runtime_parser, quiet_transformers
from specblock.runtime.config import RunConfig, validate

#: Runtime flags that describe one CLI run rather than a server: refused, with the reason.
CLI_ONLY = {"prompt": "--prompt", "prompt_file": "--prompt-file", "json_out": "--json", "compare": "--compare",
            "system": "--system", "raw": "--raw"}
WARMUP_TEXT = "Hello! How are you today?"

if TYPE_CHECKING:
    from specblock.serve.app import Service


class ServeOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)  # 0: any free port (the line printed at start names it)
    max_queue: int = Field(64, ge=1)
    served_model_name: str | None = None
    shutdown_timeout: float = Field(30.0, gt=0)
    log_level: str = "warning"


def build_parser() -> argparse.ArgumentParser:
    p = runtime_parser()
    p.prog = "python -m specblock.serve"
    p.description = "An OpenAI-compatible server in front of one lossless speculative decoding engine."
    g = p.add_argument_group("serving")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000, help="0: pick a free port")
    g.add_argument("--max-queue", type=int, default=64, help="requests waiting for the engine before a 503")
    g.add_argument("--served-model-name", help="the model id clients send (default: the --target name)")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds SIGTERM waits for in-flight requests before cancelling them")
    g.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    return p


def parse(argv: list[str]) -> tuple[RunConfig, ServeOptions]:
    parser = build_parser()
    values = vars(parser.parse_args(argv))
    defaults = vars(parser.parse_args([]))
    for key, flag in CLI_ONLY.items():
        if key in values and values[key] != defaults.get(key):
            raise SpecBlockError(f"{flag} is for the CLI; the server takes prompts over HTTP (drop {flag})")
    serve = {k: values.pop(k) for k in ServeOptions.model_fields}
    try:
        opts = ServeOptions(**serve)
    except ValidationError as e:
        err = e.errors()[0]
        raise SpecBlockError(f"--{str(err['loc'][0]).replace('_', '-')}: {err['msg']}") from None
    return validate(values), opts


def model_names(cfg: RunConfig, opts: ServeOptions) -> tuple[str, frozenset[str]]:
    """The id clients send: --served-model-name, else the --target name, else its directory's name."""
    target = cfg.target if cfg.target is not None else DEFAULT_TARGET_NAME
    default = target if target in MODELS else Path(target).name
    name = opts.served_model_name or default
    return name, frozenset({str(target), default} - {name})


def listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise SpecBlockError(f"cannot listen on {host}:{port} ({e.strerror}); pick another --port or --host") from None
    sock.set_inheritable(True)
    return sock


def open_service(cfg: RunConfig, opts: ServeOptions, trace: TextIO | None = None) -> "Service":
    """Load target, drafter and engine once (the CLI's Session) and wrap them for HTTP."""
    from specblock.serve.app import ServeSettings, Service

    session = Session.open(cfg, trace)
    if cfg.warmup:
        # --compile: every tree size compiled before the first request, all at once (a first start
        # compiles some in helper processes: compiled/warm_helpers.py), then the warm-up request
        session.warm_compiled()
        session.warmup(list(session.tokenizer(WARMUP_TEXT)["input_ids"]))
    if session.adapter is not None:
        session.adapter.clear()  # the warm-up is not served traffic
    gcstart.done()  # loaded and warmed: what the start built is frozen (specblock/gcstart.py)
    name, aliases = model_names(cfg, opts)
    return Service(session, ServeSettings(model_name=name, aliases=aliases, max_queue=opts.max_queue))


def serve(cfg: RunConfig, opts: ServeOptions) -> int:
    import uvicorn

    from specblock.serve.app import create_app

    sock = listen(opts.host, opts.port)  # before loading: a taken port fails in a second, not a minute
    trace = cfg.trace.open("w") if cfg.trace else None
    try:
        service = open_service(cfg, opts, trace)
        name = service.settings.model_name
        app = create_app(service)
        config = uvicorn.Config(app, log_level=opts.log_level, timeout_graceful_shutdown=opts.shutdown_timeout,
                                lifespan="on", access_log=opts.log_level in ("info", "debug"))
        server = uvicorn.Server(config)
        host, port = sock.getsockname()[:2]
        # Until uvicorn installs its own handler (inside run), a SIGTERM asks the server to stop as
        # soon as it has started; it used to be dropped there, and a client that stopped the server
        # right after the line below waited forever. uvicorn re-raises the SIGTERM it drained on,
        # which lands here too: a clean exit 0 instead of death by signal.
        signal.signal(signal.SIGTERM, lambda *_: setattr(server, "should_exit", True))
        print(f"specblock.serve: listening on http://{host}:{port}/v1 (model {name}, method {cfg.method})",
              flush=True)
        server.run(sockets=[sock])
    finally:
        sock.close()
        if trace is not None:
            trace.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    quiet_transformers()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return serve(*parse(argv))
    except SpecBlockError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
