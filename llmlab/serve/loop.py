"""The one engine loop behind every HTTP request (continuous batching across clients).

A server has one :class:`~llmlab.engine.LLMEngine` and one thread that owns it: only that
thread calls ``add_request``, ``step`` and ``abort_request``, and only it uses the LLM's
tokenizer (the engine decodes the new tokens), so neither needs a lock. HTTP handlers run
on the asyncio event loop; they hand a request to the thread through a command queue, and
the thread puts what happens to it (accepted or rejected, each new token, the final output,
an error) on the request's own ``asyncio.Queue`` with ``loop.call_soon_threadsafe``.
Commands are taken between two steps, so a request that arrives while a batch is decoding
joins it at the next step: with the ``"continuous"`` scheduler that is iteration-level
batching (Orca, Yu et al., OSDI 2022,
https://www.usenix.org/conference/osdi22/presentation/yu) across HTTP clients.

Faults, and why one request cannot fail another:

* taking a command, adding a request and delivering a request's tokens are guarded one
  request at a time: an exception fails that request alone (``rejected`` when its input
  was refused, ``error`` otherwise);
* a step that raises has already put the engine back in order (its sequences wait to be
  recomputed). The engine notes on the exception which requests' own parameters raised it
  (:func:`llmlab.engine.llm.culprits`); those fail, and the others go on at the next step.
  An exception no request is blamed for (the forward itself) fails the requests of that
  step, not the ones still waiting;
* the thread itself ends only with :meth:`EngineLoop.stop`, or on an exception no guard
  expected (``BaseException``): then :attr:`EngineLoop.death` says why, every open request
  gets an error, and :meth:`submit` refuses at once (:class:`EngineDead`; the server
  answers 503 and ``/health`` gives the reason);
* a client that goes away sends an ``abort`` command (its blocks are freed by the engine
  thread); a full waiting queue refuses new requests at once (:class:`QueueFull`), which
  keeps it bounded; :meth:`EngineLoop.stop` ends the thread and fails whatever is still
  queued (:class:`ShuttingDown`).

Every submitted request gets exactly one final event (``done``, ``rejected`` or
``error``). While serving, the engine keeps no per-step log (it would grow forever).

The loop talks to a request's handler through :class:`Handle`'s ``accept``, ``send``,
``finish`` and ``fail``. :class:`AsyncEngineLoop` serves with a loop written as a coroutine
instead (``create_app(..., engine_loop=run)``): notebook 10's build, the same idea on the
event loop, with the step in a worker thread. Taught in notebook 10.
"""
from __future__ import annotations

import asyncio
import queue
import threading
import traceback
import weakref
from dataclasses import dataclass, field

from ..engine import LLM, SamplingParams
from ..engine.llm import culprits


class Refused(RuntimeError):
    """The loop takes no new request now; ``code`` is the error code a server answers
    (with 503: try again later, or elsewhere)."""

    code = "unavailable"


class QueueFull(Refused):
    """The waiting queue holds ``max_waiting`` requests."""

    code = "queue_full"


class ShuttingDown(Refused):
    """:meth:`EngineLoop.stop` was called: the server is going away."""

    code = "shutting_down"


class EngineDead(Refused):
    """The engine thread ended on an exception (:attr:`EngineLoop.death` says which)."""

    code = "engine_dead"


@dataclass
class Event:
    """What the engine thread tells a request's handler.

    ``kind``: ``"accepted"``; ``"token"`` (``index`` of the completion, ``token_id``,
    ``text`` newly shown, ``finish_reason`` once it ends, ``logprobs`` of the token);
    ``"done"`` (``output``, the final :class:`~llmlab.engine.RequestOutput`);
    ``"rejected"`` (its input was refused, a 400: ``message``, and ``param``, the field
    to blame); ``"error"`` (``message``; ``code`` ``"engine_error"`` for a 500,
    ``"shutting_down"`` or ``"engine_dead"`` for a 503)."""

    kind: str
    index: int = 0
    token_id: int | None = None
    text: str = ""
    finish_reason: str | None = None
    output: object = None
    message: str = ""
    logprobs: dict | None = None           # this token's {token id: logprob}, if asked for
    param: str | None = None
    code: str | None = None


@dataclass(eq=False)
class Handle:
    """One HTTP request as the loop sees it: its prompt, parameters and event queue.

    An engine loop answers the request's HTTP handler through four methods (the library's
    :class:`EngineLoop` uses them, and so does a loop written for :class:`AsyncEngineLoop`):
    :meth:`accept` once the engine has the request, :meth:`send` for each new token,
    :meth:`finish` with the final output, :meth:`fail` when it cannot be served. Each may
    be called from any thread."""

    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    events: asyncio.Queue
    aloop: asyncio.AbstractEventLoop
    request_id: int | None = None          # the engine's, once accepted
    request: object = None                 # the engine's Request, once accepted
    shown: dict = field(default_factory=dict)   # characters shown, per completion
    closed: bool = False                   # a final event was sent
    llm: object = None                     # the served LLM: its detokenized text
    metrics: object = None                 # ServerMetrics, if the server keeps them
    seen_client_at: float = 0.0            # when the handler last found its client there

    def post(self, event: Event) -> None:
        """Put ``event`` on the handler's queue (thread-safe); nothing after a final one."""
        if self.closed:
            return
        self.closed = event.kind in ("done", "rejected", "error")
        try:
            self.aloop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:                 # the event loop is closed: nobody listens
            pass

    def accept(self, request) -> bool:
        """The engine took the request (``engine.add_request``'s return value): the
        handler may start its response. False, and a 400 for the client, when the engine
        refused it (``request.error``: it can never run)."""
        if request.error is not None:
            self.post(Event("rejected", message=request.error, param=request.error_param))
            return False
        self.request_id, self.request = request.request_id, request
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(len(self.prompt_token_ids))
        self.post(Event("accepted"))
        return True

    def send(self, seq, token_id: int) -> None:
        """A new token of one of the request's sequences (a pair of ``engine.step()``):
        the handler streams the text it settles (a tail that may become a stop string
        is held back, as :meth:`LLM.stream` does)."""
        text = self.llm._new_text(seq, self.shown)
        lps = getattr(seq, "logprobs", None)
        self.post(Event("token", seq.index, token_id, text,
                        seq.status.value if seq.finished else None,
                        logprobs=lps[-1] if lps else None))

    def finish(self, output) -> None:
        """The request is over, finished or aborted: ``output`` is ``engine.output(request)``.
        The handler ends its response; the server's metrics count it once."""
        if self.closed:
            return
        if self.metrics is not None:
            for c in output.outputs:
                if c.metrics is not None:
                    self.metrics.observe(c.metrics, c.finish_reason)
        self.post(Event("done", output=output))

    def fail(self, message: str, code: str = "engine_error") -> None:
        """The request ends with an error (a 500, or a 503 for ``shutting_down`` and
        ``engine_dead``)."""
        self.post(Event("error", message=message, code=code))


class EngineLoop:
    """Runs ``llm.engine`` in a background thread; see the module docstring.

    ``max_waiting``: requests that may wait for a seat (queued commands included)
    before :meth:`submit` raises :class:`QueueFull`.
    """

    def __init__(self, llm: LLM, max_waiting: int = 256, metrics=None):
        if not isinstance(max_waiting, int) or max_waiting < 1:
            raise ValueError(f"max_waiting={max_waiting!r} must be an int >= 1")
        self.llm, self.engine = llm, llm.engine
        self.max_waiting = max_waiting
        self.metrics = metrics
        self.death: str | None = None        # why the thread died, if it did
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._closed = False                 # the thread takes no more commands
        self._queued = 0                     # submitted, not yet taken by the thread
        self._handles: dict[int, Handle] = {}
        self.num_running = self.num_waiting_in_engine = self.kv_blocks_used = 0
        self._thread = threading.Thread(target=self._run, name="llmlab-engine", daemon=True)

    # -- called from the event loop ------------------------------------------------------
    def start(self) -> None:
        if self.llm.served_by is not None:
            raise RuntimeError("this LLM is already served by another EngineLoop")
        self.llm.served_by = self          # its offline calls now refuse (LLM._check_not_served)
        try:
            self._thread.start()
        except BaseException:
            self.llm.served_by = None
            raise

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    def health(self) -> tuple[bool, str]:
        """(serving?, why not): for ``/health``."""
        if self.death is not None:
            return False, f"the engine thread died: {self.death}"
        if self._stop.is_set() or self._closed:
            return False, "the server is shutting down"
        if not self._thread.is_alive():
            return False, "the engine thread is not running"
        return True, "ok"

    @property
    def num_waiting(self) -> int:
        return self._queued + self.num_waiting_in_engine

    def submit(self, prompt_token_ids: list[int], params: SamplingParams,
               prompt: str | None = None) -> Handle:
        """Queue a request for the engine thread; its events arrive on ``handle.events``.
        Raises :class:`EngineDead`, :class:`ShuttingDown` or :class:`QueueFull` (all
        :class:`Refused`) when the thread will not take it."""
        aloop = asyncio.get_running_loop()
        h = Handle(list(prompt_token_ids), params, prompt, asyncio.Queue(), aloop,
                   llm=self.llm, metrics=self.metrics)
        with self._lock:                     # the thread closes under this lock: no command
            if self.death is not None:       # is queued after its last look at the queue
                raise EngineDead(f"the engine thread died: {self.death}")
            if self._stop.is_set() or self._closed:
                raise ShuttingDown("the server is shutting down")
            if self.num_waiting >= self.max_waiting:
                raise QueueFull(f"the waiting queue is full ({self.max_waiting} requests "
                                "wait for a seat); retry later")
            self._queued += 1
            self._commands.put(("add", h))
        self._wake.set()
        return h

    def abort(self, h: Handle) -> None:
        """The client went away: the engine thread aborts the request (frees its blocks)."""
        self._commands.put(("abort", h))
        self._wake.set()

    def stop(self, timeout: float = 10.0) -> None:
        """End the thread after its current step; queued requests get an error event."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- the engine thread ---------------------------------------------------------------
    def _run(self) -> None:
        self.engine.record_steps = False     # a server steps forever: no step log
        reason, code = "the server is shutting down", ShuttingDown.code
        try:
            while not self._stop.is_set():
                try:
                    self._iterate()
                except Exception as e:       # a fault in the loop itself, not a request's
                    traceback.print_exc()
                    self._fail_all(f"the server failed: {type(e).__name__}: {e}")
        except BaseException as e:           # nothing expected this: the thread ends
            self.death = f"{type(e).__name__}: {e}"
            reason, code = f"the engine thread died: {self.death}", EngineDead.code
            traceback.print_exc()
        finally:
            with self._lock:
                self._closed = True
            self._take_commands(refuse=(reason, code))
            self._fail_all(reason, code)
            self.engine.record_steps = True
            if self.llm.served_by is self:
                self.llm.served_by = None

    def _iterate(self) -> None:
        self._wake.clear()                   # before taking commands: no wake-up is lost
        self._take_commands()
        if not self.engine.has_unfinished():
            self._wake.wait(1.0)
            return
        try:
            produced = self.engine.step()
        except Exception as e:               # the engine has recovered: blame, then go on
            traceback.print_exc()
            message = f"the engine failed on this request: {type(e).__name__}: {e}"
            blamed = culprits(e) or self.engine.step_request_ids
            if blamed:
                for rid in blamed:
                    self._fail(self._handles.get(rid), message)
            else:
                self._fail_all(message)
            self._update_gauges()
            return
        self._deliver(produced)
        self._update_gauges()
        if self.engine.idle:                 # nothing could run: do not spin
            self._wake.wait(0.01)

    def _post(self, h: Handle, event: Event) -> None:
        h.post(event)

    def _take_commands(self, refuse: tuple[str, str] | None = None) -> None:
        while True:
            try:
                cmd, h = self._commands.get_nowait()
            except queue.Empty:
                break
            try:
                if cmd == "add":
                    with self._lock:
                        self._queued -= 1
                    if refuse is not None:
                        self._post(h, Event("error", message=refuse[0], code=refuse[1]))
                    else:
                        self._add(h)
                elif h.request_id is not None and not h.closed:
                    self.engine.abort_request(h.request_id)
                    self._finish(h)
            except Exception as e:           # this request fails; the others are taken
                traceback.print_exc()
                self._fail(h, f"the server failed on this request: {type(e).__name__}: {e}")
        self._update_gauges()

    def _add(self, h: Handle) -> None:
        try:
            req = self.engine.add_request(h.prompt_token_ids, h.params, h.prompt)
        except ValueError as e:              # the engine refused the input (token ids)
            self._post(h, Event("rejected", message=str(e), param="prompt"))
            return
        if h.accept(req):
            self._handles[req.request_id] = h

    def _deliver(self, produced) -> None:
        done = []
        for seq, tok in produced:
            h = self._handles.get(seq.request.request_id)
            if h is None:
                continue
            try:
                h.send(seq, tok)             # LLM.stream's rule: holds back a stop string
                if seq.request.finished:
                    done.append(h)
            except Exception as e:           # this request fails; the others get their tokens
                traceback.print_exc()
                self._fail(h, f"the server failed on this request: {type(e).__name__}: {e}")
        for h in dict.fromkeys(done):
            if not h.closed:
                self._finish(h)

    def _finish(self, h: Handle) -> None:
        """The request is finished (or aborted): its final output, once, and metrics."""
        self._handles.pop(h.request_id, None)
        h.finish(self.engine.output(h.request))

    def _fail(self, h: Handle | None, message: str, code: str = "engine_error") -> None:
        """One request ends with an error event; the engine drops it (frees its blocks)."""
        if h is None:
            return
        if h.request_id is not None:
            self._handles.pop(h.request_id, None)
            try:
                self.engine.abort_request(h.request_id)
            except Exception:                # its error event must still go out
                traceback.print_exc()
        self._post(h, Event("error", message=message, code=code))

    def _fail_all(self, message: str, code: str = "engine_error") -> None:
        for h in list(self._handles.values()):
            self._fail(h, message, code)
        self._update_gauges()

    def _update_gauges(self) -> None:
        sch = self.engine.scheduler
        self.num_running = len({s.request.request_id for s in list(sch.running)})
        self.num_waiting_in_engine = len({s.request.request_id for s in list(sch.waiting)})
        self.kv_blocks_used = self.engine.cache.manager.num_used_blocks


class AsyncEngineLoop:
    """The engine loop as a coroutine you write: ``run(engine, inbox)`` runs as one asyncio
    task on the server's event loop, the loop every HTTP handler runs on, from start-up to
    shutdown. ``create_app(llm, name, engine_loop=run)`` serves with it; notebook 10's
    build is such a ``run``. The routes see the interface of :class:`EngineLoop`.

    ``engine`` is the served LLM's :class:`~llmlab.engine.llm.LLMEngine`. ``inbox`` is an
    ``asyncio.Queue`` of ``(kind, handle)`` pairs put by the handlers: ``("add", h)`` when
    a client sends a request (``h.prompt_token_ids``, ``h.params``, ``h.prompt``), and
    ``("abort", h)`` when its client goes away before the end. The loop answers each
    handler through ``h.accept(request)``, ``h.send(seq, token_id)`` and
    ``h.finish(output)`` (:class:`Handle`).

    If ``run`` raises or returns, the server stops serving: every open request gets an
    error, ``/health`` says why (:attr:`death`), :attr:`exception` keeps what was raised,
    and new requests get 503. :meth:`stop` cancels the task; a step running in another
    thread at that moment finishes there.
    """

    def __init__(self, llm: LLM, run, max_waiting: int = 256, metrics=None):
        if not asyncio.iscoroutinefunction(run):
            raise TypeError(f"engine_loop must be a coroutine function (async def run(engine, "
                            f"inbox)); got {run!r}")
        if not isinstance(max_waiting, int) or max_waiting < 1:
            raise ValueError(f"max_waiting={max_waiting!r} must be an int >= 1")
        self.llm, self.engine, self.run = llm, llm.engine, run
        self.max_waiting, self.metrics = max_waiting, metrics
        self.death: str | None = None        # why the loop ended, if it did
        self.exception: BaseException | None = None
        self.inbox: asyncio.Queue | None = None
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._open: weakref.WeakSet = weakref.WeakSet()   # handles that may need an error
        self._gauges = [0, 0, 0]
        self.log_errors = True               # print the traceback if run raises

    def start(self) -> None:
        """Start the task on the running event loop (the server's lifespan calls it)."""
        if self.llm.served_by is not None:
            raise RuntimeError("this LLM is already served by another engine loop")
        self.inbox = asyncio.Queue()
        self.llm.served_by = self
        self.engine.record_steps = False     # a server steps forever: no step log
        self._task = asyncio.get_running_loop().create_task(self._main())

    async def _main(self) -> None:
        try:
            await self.run(self.engine, self.inbox)
            why = "the engine loop returned"
        except asyncio.CancelledError:
            if not self._stopping:
                self.death = "the engine loop was cancelled"
            self._end(self.death or "the server is shutting down",
                      EngineDead.code if self.death else ShuttingDown.code)
            raise
        except Exception as e:               # the loop's own bug: the server stops serving
            if self.log_errors:
                traceback.print_exc()
            self.exception = e
            why = f"{type(e).__name__}: {e}"
        self.death = why
        self._end(f"the engine loop ended: {why}", EngineDead.code)

    def _end(self, message: str, code: str) -> None:
        for h in list(self._open):
            h.fail(message, code)
        self.engine.record_steps = True
        if self.llm.served_by is self:
            self.llm.served_by = None

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done() and not self._stopping

    def health(self) -> tuple[bool, str]:
        """(serving?, why not): for ``/health``."""
        if self.death is not None:
            return False, f"the engine loop ended: {self.death}"
        if self._stopping:
            return False, "the server is shutting down"
        if self._task is None or self._task.done():
            return False, "the engine loop is not running"
        return True, "ok"

    def submit(self, prompt_token_ids: list[int], params: SamplingParams,
               prompt: str | None = None) -> Handle:
        """Put ``("add", handle)`` in the inbox; raises :class:`Refused` as
        :meth:`EngineLoop.submit` does."""
        if self.death is not None:
            raise EngineDead(f"the engine loop ended: {self.death}")
        if self._stopping or self._task is None:
            raise ShuttingDown("the server is shutting down")
        if self.num_waiting >= self.max_waiting:
            raise QueueFull(f"the waiting queue is full ({self.max_waiting} requests wait "
                            "for a seat); retry later")
        h = Handle(list(prompt_token_ids), params, prompt, asyncio.Queue(),
                   asyncio.get_running_loop(), llm=self.llm, metrics=self.metrics)
        self._open.add(h)
        self.inbox.put_nowait(("add", h))
        return h

    def abort(self, h: Handle) -> None:
        """The client went away: ``("abort", handle)`` goes to the inbox."""
        if self.inbox is not None and self.alive:
            self.inbox.put_nowait(("abort", h))

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel the task; open requests get a ``shutting_down`` error."""
        self._stopping = True
        if self._task is not None and not self._task.done():
            self._task.cancel()
        self._end("the server is shutting down", ShuttingDown.code)

    # gauges for /metrics, read while a step may run in another thread: a read that
    # races with the scheduler keeps the last value
    def _gauge(self, i: int, read) -> int:
        try:
            self._gauges[i] = read()
        except RuntimeError:                 # a queue changed while it was read
            pass
        return self._gauges[i]

    @property
    def num_running(self) -> int:
        return self._gauge(0, lambda: len({s.request.request_id
                                            for s in list(self.engine.scheduler.running)}))

    @property
    def num_waiting(self) -> int:
        queued = self.inbox.qsize() if self.inbox is not None else 0
        return queued + self._gauge(1, lambda: len({s.request.request_id
                                                    for s in list(self.engine.scheduler.waiting)}))

    @property
    def kv_blocks_used(self) -> int:
        return self._gauge(2, lambda: self.engine.cache.manager.num_used_blocks)


__all__ = ["EngineLoop", "AsyncEngineLoop", "Event", "Handle", "Refused", "QueueFull",
           "ShuttingDown", "EngineDead"]
