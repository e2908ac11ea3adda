"""The server as a child process: start it on a free port, wait until it answers, stop it.

    with ServerProcess("smollm2-135m", scheduler="continuous") as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")
        ...
    # leaving the block sends SIGINT: uvicorn's clean shutdown, the engine thread too

Used by notebook 10, ``python -m llmlab.bench serve-http`` and the tests.
"""
from __future__ import annotations

import atexit
import signal
import subprocess
import sys
import time

from ..parallel.group import free_port   # also the rendezvous port of notebook 07


def start_server(model: str, scheduler: str, port: int, extra: list[str] = (),
                 timeout_s: float = 180.0, log=None) -> subprocess.Popen:
    """``python -m llmlab.serve`` in a subprocess; returns once ``/health`` answers."""
    import httpx

    cmd = [sys.executable, "-m", "llmlab.serve", "--model", model, "--scheduler", scheduler,
           "--host", "127.0.0.1", "--port", str(port), *extra]
    proc = subprocess.Popen(cmd, stdout=log or subprocess.DEVNULL, stderr=log or subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode}: {' '.join(cmd)}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    stop_server(proc)
    raise RuntimeError(f"the server did not answer /health within {timeout_s:.0f} s")


def stop_server(proc: subprocess.Popen, timeout_s: float = 20.0) -> int:
    """SIGINT (a clean uvicorn shutdown), then SIGKILL if it does not exit in time."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


class ServerProcess:
    """``python -m llmlab.serve`` on a free localhost port, as a context manager.

    ``extra``: more command-line options, e.g. ``["--max-num-seqs", "8"]``.
    ``base_url`` is ``http://127.0.0.1:PORT`` (the OpenAI client wants ``base_url + "/v1"``).
    """

    def __init__(self, model: str = "smollm2-135m", scheduler: str = "continuous",
                 extra: list[str] = (), timeout_s: float = 180.0, log=None):
        self.model, self.scheduler = model, scheduler
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.proc = start_server(model, scheduler, self.port, list(extra), timeout_s, log)
        # a kernel restarted or a script ended without stop(): do not leave the server behind
        atexit.register(self.stop)

    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> int:
        """Stop the server (SIGINT); its exit status (0 after a clean shutdown)."""
        atexit.unregister(self.stop)
        return stop_server(self.proc)

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else f"exited {self.proc.returncode}"
        return f"<ServerProcess {self.model} ({self.scheduler}) at {self.base_url}: {state}>"


class ThreadServer:
    """uvicorn serving ``app`` (from :func:`llmlab.serve.create_app`) on a free localhost
    port, in a daemon thread of this process, as a context manager: a server whose
    engine loop is a function defined here (notebook 10's build), which a child process
    could not run. ``base_url`` as :class:`ServerProcess`'s."""

    def __init__(self, app, timeout_s: float = 60.0):
        import threading

        import uvicorn

        self.app = app
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, name="llmlab-uvicorn",
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the in-process server did not start within {timeout_s:g} s")
            time.sleep(0.02)

    @property
    def running(self) -> bool:
        return self.thread.is_alive()

    def close(self, timeout_s: float = 20.0) -> None:
        """uvicorn's clean shutdown (the engine loop stops with the app's lifespan)."""
        self.server.should_exit = True
        self.thread.join(timeout_s)

    def __enter__(self) -> "ThreadServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["ServerProcess", "ThreadServer", "free_port", "start_server", "stop_server"]
