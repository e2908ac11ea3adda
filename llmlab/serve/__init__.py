"""An OpenAI-compatible HTTP server over llmlab's engine (notebook 10).

    python -m llmlab.serve --model smollm2-135m --host 127.0.0.1 --port 8000
    # or the console script:  llmlab-serve --model smollm2-135m

then any OpenAI client with ``base_url="http://127.0.0.1:8000/v1"``. One engine loop
runs in a background thread (:mod:`llmlab.serve.loop`); requests from all clients join
its batch between steps. :mod:`llmlab.serve.client` holds the small pieces of a load
generator (Poisson arrivals, an SSE parser, percentiles) that ``python -m llmlab.bench
serve-http`` uses. FastAPI, uvicorn and prometheus_client come with the ``serve`` extra:
nothing here imports them until :func:`create_app` or :func:`main` is called.
"""
from __future__ import annotations


def create_app(*args, **kwargs):
    """See :func:`llmlab.serve.app.create_app` (imported on first use)."""
    from .app import create_app as _create_app

    return _create_app(*args, **kwargs)


def main(argv: list[str] | None = None) -> int:
    """The command line (see :mod:`llmlab.serve.__main__`)."""
    from .__main__ import main as _main

    return _main(argv)


__all__ = ["create_app", "main"]
