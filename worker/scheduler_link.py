"""The worker's end of its link to the scheduler: the socket, the handshake, silence and
heartbeats. What the messages do is the process loop's (``worker.process``).

A plain blocking ZeroMQ DEALER with poll timeouts. Every message is one frame (a
msgspec msgpack message; the scheduler's ROUTER sees ``[identity, frame]``).

* Connect, send WorkerHello, wait for WorkerReady; a Shutdown instead is a refusal:
  exit 4 (EXIT_REFUSED), so that a supervisor tries again. No WorkerReady within
  ``scheduler_timeout_s``: the scheduler is unreachable, as below.
* Then answer each message (``_handle``). Incoming heartbeats only prove the scheduler
  is alive: they are not answered (two sides that answer each other's heartbeats would
  ping-pong); instead the worker sends its own whenever it has sent nothing for a
  heartbeat interval.
* Silence from the scheduler for ``scheduler_timeout_s``, or its connection dropped: exit
  3, or with ``reconnect`` drop every row and handshake again.
* SIGTERM (``WorkerStopping``, raised by the handler ``worker.startup`` installs):
  tell the scheduler with WorkerExit and exit 0.
"""

from __future__ import annotations

import logging
import math
import time
from abc import ABC, abstractmethod

import zmq

from protocol.codec import Codec, ProtocolError
from protocol.curve import apply_client
from protocol.worker_messages import (
    Heartbeat,
    SchedulerToWorker,
    Shutdown,
    StepPlan,
    WorkerError,
    WorkerExit,
    WorkerHello,
    WorkerReady,
)
from worker.config import WorkerConfig

log = logging.getLogger("worker")

EXIT_SCHEDULER_LOST = 3
EXIT_REFUSED = 4
# How often the loop looks for news (a grammar compiled, a load or a pull ended) while any is awaited.
NEWS_POLL_S = 0.002


class SchedulerLost(Exception):
    """No message from the scheduler within the timeout."""


class Refused(Exception):
    """The scheduler answered the hello with Shutdown: the reason."""


class WorkerStopping(Exception):
    """SIGTERM: stop cleanly."""


class SchedulerLink(ABC):
    """The link's states and timeouts; a subclass says what to send and what each message does:
    ``hello``, ``_install`` (WorkerReady: None, or the reason it is refused), ``_set_ready``
    (None: every row dropped), ``_handle`` (one message: a reply, False for none, None to
    exit), ``_send_news`` and ``_awaits_news``."""

    def __init__(self, config: WorkerConfig):
        self.config = config
        self.codec: Codec = Codec(SchedulerToWorker)

    @abstractmethod
    def hello(self) -> WorkerHello:
        raise NotImplementedError

    @abstractmethod
    def _install(self, ready: WorkerReady) -> str | None:
        raise NotImplementedError

    @abstractmethod
    def _set_ready(self, runner) -> None:
        raise NotImplementedError

    @abstractmethod
    def _handle(self, sock: zmq.Socket):
        raise NotImplementedError

    @abstractmethod
    def _send_news(self, sock: zmq.Socket) -> bool:
        raise NotImplementedError

    @abstractmethod
    def _awaits_news(self) -> bool:
        raise NotImplementedError

    def run(self, ctx: zmq.Context) -> int:
        """Serve until Shutdown (0) or a fatal condition (non-zero)."""
        while True:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            if self.config.curve_client_key is not None:
                apply_client(sock, self.config.curve_client_key, self.config.curve_server_key)
            sock.connect(self.config.scheduler)
            try:
                ready = self._handshake(sock)
                refused = self._install(ready)
                if refused is not None:
                    self._send(sock, WorkerError(refused))
                    log.error("refusing WorkerReady: %s", refused)
                    return EXIT_REFUSED
                self._send(sock, Heartbeat(sent_at=time.time()))  # acknowledges WorkerReady
                return self._serve(sock)
            except Refused as e:
                log.error("refused by the scheduler at %s: %s", self.config.scheduler, e)
                return EXIT_REFUSED
            except SchedulerLost as e:
                if not self.config.reconnect:
                    log.error("%s; exiting (use --reconnect to handshake again instead)", e)
                    return EXIT_SCHEDULER_LOST
                log.warning("%s; dropping every row and handshaking again", e)
                self._set_ready(None)
            except WorkerStopping:
                log.info("SIGTERM: telling the scheduler and exiting")
                # NOTE: linger, so the goodbye leaves before the socket closes.
                self._send(sock, WorkerExit("SIGTERM"))
                sock.close(linger=1000)
                return 0
            finally:
                sock.close(linger=0)

    def _send(self, sock: zmq.Socket, msg) -> None:
        sock.send(self.codec.encode(msg))

    def _recv(self, sock: zmq.Socket):
        frames = sock.recv_multipart()
        # NOTE: the message is the last frame, so an empty delimiter frame (REQ-style
        # envelope) from the scheduler is tolerated.
        return self.codec.decode(frames[-1])

    def _handshake(self, sock: zmq.Socket) -> WorkerReady:
        """WorkerReady; Refused on Shutdown, SchedulerLost after scheduler_timeout_s."""
        hello = self.hello()
        self._send(sock, hello)
        log.info("sent WorkerHello (%d blocks of %d tokens) to %s", hello.num_blocks, hello.block_size, self.config.scheduler)
        timeout = self.config.scheduler_timeout_s
        start = time.monotonic()
        while True:
            waited = time.monotonic() - start
            if waited >= timeout:
                raise SchedulerLost(
                    f"no WorkerReady from the scheduler at {self.config.scheduler} within {timeout} s "
                    "(--scheduler-timeout): is it running, and is --scheduler its worker port?"
                )
            if not sock.poll(math.ceil(min(5.0, timeout - waited) * 1000)):
                log.info("still waiting for WorkerReady from %s (%.0f s)", self.config.scheduler, time.monotonic() - start)
                continue
            try:
                msg = self._recv(sock)
            except ProtocolError as e:
                self._send(sock, WorkerError(str(e)))
                continue
            match msg:
                case WorkerReady():
                    return msg
                case Shutdown(reason=reason):
                    raise Refused(reason or "(no reason given)")
                case Heartbeat():
                    pass
                case StepPlan(step_id=step_id):
                    self._send(sock, WorkerError("plan before WorkerReady", step_id=step_id))

    def _serve(self, sock: zmq.Socket) -> int:
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            return self._serve_until_lost(sock, monitor)
        finally:
            sock.disable_monitor()
            monitor.close(linger=0)

    def _serve_until_lost(self, sock: zmq.Socket, monitor: zmq.Socket) -> int:
        """Answer the scheduler until Shutdown; SchedulerLost after its silence or as soon as
        its connection drops (a scheduler that died and is restarting: the next one is a
        new handshake, with ``reconnect``)."""
        timeout, interval = self.config.scheduler_timeout_s, self.config.heartbeat_interval_s
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        last_heard = last_sent = time.monotonic()
        while True:
            now = time.monotonic()
            wait = min(last_heard + timeout, last_sent + interval) - now
            if self._awaits_news():
                # NOTE: news ends on another thread: look for it often meanwhile.
                wait = min(wait, NEWS_POLL_S)
            # NOTE: poll even when the wait is over, so a message that queued up
            # during a long step counts as heard rather than as a timeout.
            ready = dict(poller.poll(max(0, math.ceil(wait * 1000))))
            if monitor in ready and not ready.get(sock):
                monitor.recv_multipart()
                raise SchedulerLost(f"lost the connection to the scheduler at {self.config.scheduler}")
            if ready:
                reply = self._handle(sock)
                if reply is None:
                    return 0
                # NOTE: news first: a load that ended during the step is heard before its result, so the
                # scheduler's next plan schedules its request.
                sent = self._send_news(sock)
                if reply is not False:
                    self._send(sock, reply)
                    sent = True
                last_heard = time.monotonic()
                if sent:
                    last_sent = last_heard
                continue
            if self._send_news(sock):
                last_sent = time.monotonic()
            now = time.monotonic()
            if now - last_heard >= timeout:
                raise SchedulerLost(f"no message from the scheduler at {self.config.scheduler} for {now - last_heard:.1f} s (--scheduler-timeout {timeout} s)")
            if now - last_sent >= interval:
                self._send(sock, Heartbeat(sent_at=time.time()))
                last_sent = now
