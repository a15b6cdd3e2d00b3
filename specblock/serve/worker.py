"""The engine's one owner: a thread that runs queued requests one at a time, in arrival order.

The decode loop is single-sequence and stateful (the target's KV cache, the drafter's caches), so
exactly one thread may touch it. HTTP handlers only build a ``Job`` and read the events it emits;
the queue between them is the seam where a batching scheduler would go later.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from specblock.errors import SpecBlockError
from specblock.runtime.cli import Session
from specblock.runtime.metrics import DecodeStats
from specblock.runtime.verify import GreedyVerifier, SamplingVerifier
from specblock.serve.metrics import ServeMetrics
from specblock.serve.protocol import APIError
from specblock.serve.text import TextStream

log = logging.getLogger("specblock.serve")

#: Status for a request whose client went away (nginx's convention; never sent, only counted).
CLIENT_GONE = 499


@dataclass
class Delta:
    text: str


@dataclass
class Done:
    text: str
    finish: str  # OpenAI's finish_reason: "stop" or "length"
    prompt_tokens: int
    completion_tokens: int
    stats: DecodeStats


@dataclass
class Failed:
    error: APIError


Event = Delta | Done | Failed


@dataclass
class Job:
    ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stops: list[str]
    stream: bool  # emit Delta events as text becomes safe to send
    sink: Callable[[Event], None]  # thread-safe: called from the worker thread
    cancel: threading.Event = field(default_factory=threading.Event)
    arrived: float = field(default_factory=time.perf_counter)


class EngineWorker:
    def __init__(self, session: Session, metrics: ServeMetrics, max_queue: int, tokenizer_lock: threading.Lock) -> None:
        self.session, self.metrics, self.max_queue = session, metrics, max_queue
        self.tokenizer_lock = tokenizer_lock
        self._q: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._waiting = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="specblock-engine", daemon=True)

    @property
    def waiting(self) -> int:
        return self._waiting

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue a job or refuse it with a 503 (full queue, or shutting down)."""
        with self._lock:
            if self._closed:
                raise APIError(503, "the server is shutting down", code="shutting_down")
            if self._waiting >= self.max_queue:
                raise APIError(503, f"the request queue is full ({self.max_queue} waiting); retry later",
                               code="queue_full")
            self._waiting += 1
            self.metrics.queue_depth.set(self._waiting)
            self._q.put(job)

    def close(self, timeout: float = 30.0) -> None:
        """Refuse new jobs, cancel queued ones, let the running one stop at its next iteration."""
        with self._lock:
            self._closed = True
            pending = list(self._q.queue)
        for job in pending:
            if job is not None:
                job.cancel.set()
        self._q.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            with self._lock:
                self._waiting -= 1
                self.metrics.queue_depth.set(self._waiting)
            if job.cancel.is_set():
                job.sink(Failed(APIError(CLIENT_GONE, "cancelled before it started")))
                continue
            self.metrics.running.set(1)
            try:
                self._serve(job)
            except Exception as e:  # never let one request kill the worker
                log.exception("generation failed")
                job.sink(Failed(APIError(500, f"generation failed: {type(e).__name__}: {e}")))
            finally:
                self.metrics.running.set(0)

    def _decode(self, ids: list[int]) -> str:
        with self.tokenizer_lock:
            return self.session.tokenizer.decode(ids, skip_special_tokens=True)

    def _serve(self, job: Job) -> None:
        engine = self.session.engine
        engine.verifier = (GreedyVerifier() if job.temperature == 0
                           else SamplingVerifier(job.temperature, job.top_p, job.seed))
        text = TextStream(self._decode, job.stops)
        times: list[float] = []  # [first token's time, latest token's time]

        def on_tokens(new: list[int]) -> bool:
            now = time.perf_counter()
            times[:] = [times[0] if times else now, now]
            delta = text.push(new)
            if job.stream and delta:
                job.sink(Delta(delta))
            return not (text.stopped or job.cancel.is_set())

        try:
            res = engine.generate(job.ids, job.max_tokens, seed=job.seed, on_tokens=on_tokens)
        except SpecBlockError as e:
            job.sink(Failed(APIError(400, str(e))))
            return
        if job.cancel.is_set() and not text.stopped:
            job.sink(Failed(APIError(CLIENT_GONE, "cancelled: the client went away")))
            return
        tail = text.rest()
        if job.stream and tail:
            job.sink(Delta(tail))
        finish = "stop" if text.stopped or res.stopped == "eos" else "length"
        n = len(res.token_ids)
        ttft = times[0] - job.arrived if times else None
        tpot = (times[-1] - times[0]) / (n - 1) if times and n > 1 else None
        self.metrics.served(len(job.ids), text.n_tokens, res.stats, ttft, tpot, time.perf_counter() - job.arrived)
        if self.session.adapter is not None:
            self.metrics.adaptation(self.session.adapter.summary())
        job.sink(Done(text.text, finish, len(job.ids), text.n_tokens, res.stats))
