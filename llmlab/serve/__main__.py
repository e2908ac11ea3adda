"""``python -m llmlab.serve`` (and ``llmlab-serve``): load a model and serve it over HTTP.

    python -m llmlab.serve --model smollm2-135m --host 127.0.0.1 --port 8000 \\
        [--scheduler continuous|static] [--max-num-seqs 16] [--max-waiting 256] \\
        [--api-key KEY] [--max-body-bytes 1048576] [--max-connections 512]

``--api-key`` (or ``$LLMLAB_API_KEY``, which keeps the key out of the process list) makes
the ``/v1`` routes ask for ``Authorization: Bearer KEY``. Bound to an address other than
loopback without a key, the server says so on start: anyone who can reach the port may
use it.

uvicorn handles SIGINT and SIGTERM: it stops accepting connections; the engine thread
stops after its current step, and every open request gets an error response saying the
server is shutting down (a stream: an error event, then ``data: [DONE]``); the process
exits with status 0.
"""
from __future__ import annotations

import argparse
import ipaddress
import os
import signal
import sys


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m llmlab.serve",
                                 description="OpenAI-compatible server over llmlab's engine")
    ap.add_argument("--model", default="smollm2-135m", help="a registered model name")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--scheduler", default="continuous", choices=["continuous", "static"])
    ap.add_argument("--max-num-seqs", type=int, default=16, help="seats in the running batch")
    ap.add_argument("--max-waiting", type=int, default=256,
                    help="requests that may wait for a seat; more get 503")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="context (default: the model's)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=None, help="KV blocks in the pool")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--enable-chunked-prefill", action="store_true")
    ap.add_argument("--prefix-cache", default="hash", choices=["hash", "radix", "none"],
                    help="the prefix cache (default hash; radix: a token-level radix tree)")
    ap.add_argument("--admission", default="fcfs", choices=["fcfs", "cache_aware"],
                    help="waiting-queue order (cache_aware: longest cached prefix first)")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--graceful-timeout", type=float, default=5.0,
                    help="seconds uvicorn waits for connections to close on SIGINT/SIGTERM")
    ap.add_argument("--log-level", default="warning")
    ap.add_argument("--api-key", default=os.environ.get("LLMLAB_API_KEY") or None,
                    help="require 'Authorization: Bearer KEY' on /v1 (default: $LLMLAB_API_KEY)")
    ap.add_argument("--max-body-bytes", type=int, default=2**20,
                    help="larger request bodies get 413")
    ap.add_argument("--max-connections", type=int, default=512,
                    help="connections (and requests in flight) at once; more get 503")
    args = ap.parse_args(argv)
    if not 0 < args.port < 65536:
        ap.error(f"--port={args.port} must be in 1..65535")
    for name in ("max_body_bytes", "max_connections"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    return args


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only (127.0.0.0/8, ::1, localhost)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:                       # a host name: it may resolve to anything
        return False


def startup_warnings(host: str, api_key: str | None) -> list[str]:
    """What the server should tell its operator on start."""
    if api_key is None and not is_loopback(host):
        return [f"llmlab.serve: warning: listening on {host}, which is not a loopback "
                "address, without an API key: anyone who can reach this port may use the "
                "model. Pass --api-key (or set LLMLAB_API_KEY), or bind to 127.0.0.1."]
    return []


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import torch
    import uvicorn

    from ..engine import LLM
    from .app import create_app

    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(args.model, scheduler=args.scheduler, max_num_seqs=args.max_num_seqs,
              block_size=args.block_size, num_blocks=args.num_blocks,
              max_model_len=args.max_model_len,
              max_num_batched_tokens=args.max_num_batched_tokens,
              enable_chunked_prefill=args.enable_chunked_prefill, device=args.device,
              seed=args.seed,
              prefix_cache=None if args.prefix_cache == "none" else args.prefix_cache,
              admission=args.admission)
    app = create_app(llm, args.model, max_waiting=args.max_waiting, api_key=args.api_key,
                     max_body_bytes=args.max_body_bytes, max_connections=args.max_connections)
    for line in startup_warnings(args.host, args.api_key):
        print(line, file=sys.stderr, flush=True)
    print(f"llmlab.serve: {args.model} ({args.scheduler}) on http://{args.host}:{args.port}/v1",
          flush=True)
    # uvicorn catches SIGINT/SIGTERM, shuts down (the engine thread too), then re-raises the
    # signal to the previous handlers: make both end the process with status 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.graceful_timeout,
                            limit_concurrency=args.max_connections)
    try:
        _server_class(uvicorn)(config, app.state.server.loop).run()
    except KeyboardInterrupt:
        pass
    return 0


def _server_class(uvicorn):
    class Server(uvicorn.Server):
        """uvicorn's server, but on SIGINT/SIGTERM the engine loop stops first: every open
        request gets its answer at once (an error saying the server is shutting down; a
        stream ends with it and ``[DONE]``) instead of the shutdown waiting on it."""

        def __init__(self, config, engine_loop):
            super().__init__(config)
            self.engine_loop = engine_loop

        async def shutdown(self, sockets=None):
            self.engine_loop.stop()
            await super().shutdown(sockets)

    return Server


if __name__ == "__main__":
    sys.exit(main())
