"""What adapters report: connections, requests, sessions, activity — the hot path.

This is the part of the adapter API that runs per request and per connection, so it is
plain attribute arithmetic on the event-loop thread: no locks, no tasks, no allocation
per request, no clock read per request (connections do read the clock: their arrival is
the activity *accept until idle* watches).

Measuring requests, cheaply
---------------------------
How long draining needs is measured, not guessed (see ``graceful._core.deadlines``): from
the moment shutdown is requested every request is timed (``request_started`` returns the
start time, ``request_finished`` takes it back).  The estimate is the longest duration
sampled — while serving the longest of the last 32 to 64 (two windows, O(1) per
request), from the shutdown request on every one, so that a slow request seen at +1 s
still counts at +7 s however much fast traffic came between — or the age of the oldest
request still running, if it is older: a 3 s request in flight is evidence before it
ends.  While serving normally the only cost is one flag test: the hot path of a server
that is not shutting down stays as cheap as it can be.  An adapter whose requests
cost far more than a clock read (the WSGI workers) measures from the start
(``measure_requests_always``), so the budget at SIGTERM already knows its traffic.

Probes are not traffic
----------------------
Accept-until-idle watches new connections: they show that load balancers still send
traffic here.  But the kubelet opens a new connection for every readiness and liveness
probe (every second, often), and a load balancer's health checks do the same: counted,
they restart the idle window forever and the pod uses its whole grace period.  So an
adapter that sees requests (the ASGI middleware, the aiohttp middleware) calls
``Tracking.classify_connections`` once, and from then on a connection opened after
the shutdown request counts as activity only when its *first* request is seen and is not
a probe (``Tracking.first_request``; ``is_probe``: a health path of ours, or a
``User-Agent`` of ``kube-probe/…``).  A connection that closes without a request — a
TCP health check — does not count either.  The activity is stamped when that first
request arrives, a few milliseconds after its connection; a connection still waiting
for its first request when accepting ends is served all the same (it was accepted).
While serving nothing of this runs: the middleware checks one flag per request.

Waking waiters
--------------
A waiter (``wait_drained``, the drain loop) needs to hear when a count reaches zero, in
any phase.  Notifying at every zero would cost an event per request on an idle server,
so the counters notify only while someone waits for it (``_zero_waiters > 0``).

``Tracking`` is the base class of ``graceful.ShutdownCoordinator``; the context managers
it hands out (``Session``, the request tracker) are in ``graceful._core.sessions``, the
coordinator's other half (phases, deadlines, the ``run`` task) in
``graceful._core.engine``, behind the facade in ``graceful._core.coordinator``.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable

import anyio
import anyio.lowlevel

from .sessions import Session, _RequestTracker

__all__ = ("Session", "Tracking", "is_probe")

#: ``User-Agent`` prefix of the kubelet's HTTP probes (``kube-probe/1.30``).
PROBE_USER_AGENT = b"kube-probe/"


def is_probe(user_agent: bytes | str | None) -> bool:
    """``True`` for the ``User-Agent`` of a Kubernetes probe (``kube-probe/…``)."""
    if user_agent is None:
        return False
    if isinstance(user_agent, str):
        user_agent = user_agent.encode("latin-1", "replace")
    return user_agent.startswith(PROBE_USER_AGENT)


_WINDOW = 32  # the estimate is the longest of the last 32 to 64 samples


class Tracking:
    """Counters and the hot-path half of the adapter API (see the module docs)."""

    # Slots, not the instance dict: the coordinator has more attributes than CPython's
    # shared-key dicts hold (30), so dict attributes would be looked up by hash on every
    # request; slot access stays a fixed offset (``benchmarks/instructions.py``, "tracked").
    __slots__ = (
        "__dict__",
        "__weakref__",
        "_activity_from_requests",
        "_changed",
        "_clock",
        "_closed_draining",
        "_connections",
        "_connections_total",
        "_draining",
        "_finished_starts",
        "_first_requests",
        "_last_activity_at",
        "_measuring",
        "_nudging",
        "_previous_max",
        "_request_source",
        "_request_tracker",
        "_requests_done",
        "_requests_total",
        "_samples",
        "_sessions",
        "_shutdown_since",
        "_starts",
        "_timing",
        "_untimed_in_flight",
        "_window_max",
        "_window_n",
        "_zero_waiters",
    )

    def __init__(self) -> None:
        self._draining = False  # phase >= DRAINING, read on the hot path
        self._nudging = False  # clients should be told to close their connection
        # Requests started and requests finished; in flight is the difference (one
        # integer to update per request event instead of two).
        self._requests_total = 0
        self._requests_done = 0
        self._connections = 0
        self._connections_total = 0
        self._closed_draining = 0  # connections closed while draining (not stopping)
        self._sessions: set[Session] = set()
        self._last_activity_at: float | None = None
        # See "Probes are not traffic": whether an adapter classifies connections by
        # their first request, and the connections seen so far while accepting.
        self._activity_from_requests = False
        self._first_requests: set[object] = set()
        self._zero_waiters = 0
        self._timing = False  # shutdown was requested: time requests, watch activity
        self._measuring = False  # time requests while serving too (measure_requests_always)
        # See "Measuring requests": the start times of timed requests in flight, oldest
        # first (those finished out of order wait in _finished_starts), and how many
        # requests still in flight started before requests were timed (at _shutdown_since
        # or before).
        self._starts: collections.deque[float] = collections.deque()
        self._finished_starts: collections.Counter[float] = collections.Counter()
        self._untimed_in_flight = 0
        self._shutdown_since: float | None = None
        self._samples = 0
        self._window_max = 0.0
        self._window_n = 0
        self._previous_max = 0.0
        self._changed: anyio.Event | None = None
        self._request_tracker = _RequestTracker(self)
        self._request_source: Callable[[], tuple[int, int]] | None = None
        self._clock: Callable[[], float] | None = None

    def _now(self) -> float:
        """The event loop's clock, looked up once (protocol callbacks run outside any
        task, where anyio cannot tell which backend is running)."""
        clock = self._clock
        if clock is None:
            try:
                clock = anyio.lowlevel.current_token().backend_class.current_time
            except anyio.NoEventLoopError:
                clock = asyncio.get_running_loop().time  # an asyncio protocol callback
            self._clock = clock
        return clock()

    @property
    def _requests(self) -> int:
        """Requests reported in flight (not those of a request source)."""
        return self._requests_total - self._requests_done

    def _notify(self) -> None:
        event, self._changed = self._changed, None
        if event is not None:
            event.set()

    # ------------------------------------------------------------- requests

    def track_request(self) -> _RequestTracker:
        """Return a context manager that counts one in-flight request.

        ``with coordinator.track_request(): ...`` costs one integer update each way; the object
        returned is shared, so it needs no allocation.
        """
        return self._request_tracker

    def request_started(self) -> float | None:
        """Count one in-flight request (for adapters that cannot use a ``with``).

        Every call must be matched by one ``request_finished``, given what this
        returned: the start time of a request sampled for the duration estimate, else
        ``None``.
        """
        self._requests_total += 1
        if not (self._timing or self._measuring):
            return None
        now = self._now()
        self._starts.append(now)
        return now

    def request_finished(self, started_at: float | None = None) -> None:
        """The request counted by ``request_started`` ended (however it ended)."""
        self._requests_done += 1
        if started_at is not None:
            self._sample(self._now() - started_at)
            self._started_finished(started_at)
        elif self._untimed_in_flight:
            self._untimed_in_flight -= 1
        if self._zero_waiters and self._requests_done == self._requests_total:
            self._notify()

    def _sample(self, duration: float) -> None:
        # While serving, two windows of _WINDOW samples: the estimate is the longest of
        # the current and the previous one, so an old outlier ages out in O(1) per
        # sample.  From the shutdown request on nothing ages out: a long request seen
        # at its start still counts at its end, whatever fast traffic came between.
        if not self._samples or duration > max(self._window_max, self._previous_max):
            self._notify()  # the drain budget grew: the accepting phase may end sooner
        self._samples += 1
        if duration > self._window_max:
            self._window_max = duration
        self._window_n += 1
        if self._window_n >= _WINDOW and not self._timing:
            self._previous_max, self._window_max, self._window_n = self._window_max, 0.0, 0

    def _started_finished(self, started_at: float) -> None:
        """A timed request ended: forget its start (oldest first, the rest lazily)."""
        starts, finished = self._starts, self._finished_starts
        if starts and starts[0] == started_at:
            starts.popleft()
            while starts and finished and finished[starts[0]]:
                finished[starts[0]] -= 1
                if not finished[starts[0]]:
                    del finished[starts[0]]
                starts.popleft()
        else:
            finished[started_at] += 1

    def _start_timing(self, now: float) -> None:
        """The shutdown request: from now on time every request and keep every sample;
        the requests in flight now started at ``now`` at the latest."""
        self._timing = True
        self._shutdown_since = now
        timed = len(self._starts) - sum(self._finished_starts.values())
        self._untimed_in_flight = max(0, self._requests - timed)

    def measure_requests_always(self) -> None:
        """Time every request from now on, not only from the shutdown request.

        For adapters whose per-request cost allows a clock read (the WSGI workers):
        the drain budget then knows at SIGTERM how long this process's requests take,
        instead of assuming the conservative budget until it has measured some.
        """
        self._measuring = True

    def oldest_request_age_s(self) -> float | None:
        """How long the oldest request in flight has run, at least (``None``: none in
        flight, or requests are not timed yet)."""
        if self._untimed_in_flight and self._shutdown_since is not None:
            return self._now() - self._shutdown_since
        if self._starts:
            return self._now() - self._starts[0]
        return None

    def longest_request_s(self, *, running: bool = True) -> float | None:
        """The longest request to expect: the longest recently sampled (every one since
        the shutdown request), or the oldest still running if it has run longer
        (``running=False``: the samples only; ``None``: none yet)."""
        age = self.oldest_request_age_s() if running else None
        if not self._samples:
            return age
        longest = max(self._window_max, self._previous_max)
        return longest if age is None else max(longest, age)

    def add_request_source(self, source: Callable[[], tuple[int, int]]) -> None:
        """Let a server count some requests itself instead of reporting each one.

        For a server whose hot path does not call ``request_started`` while nothing
        shuts down (graceful's uvicorn server): ``source()`` returns ``(in_flight,
        started)`` for the requests it counts itself, and the coordinator adds them to
        its own counts (``statistics``, ``drained``, the waiters).  Before the
        coordinator's first phase change the server must report the requests still in
        flight through ``request_started``/``request_finished`` and drop them
        from ``source()``: the drain counts only what was reported.

        Raises:
            RuntimeError: if a source was added already.
        """
        if self._request_source is not None:
            raise RuntimeError("the coordinator has a request source already")
        self._request_source = source

    def _external_requests(self) -> tuple[int, int]:
        """``(in_flight, started)`` of the request source (``(0, 0)`` without one)."""
        source = self._request_source
        return (0, 0) if source is None else source()

    def track_session(self, on_drain: Callable[[], None] | None = None) -> Session:
        """Return a context manager that counts a long-lived session (websocket, stream).

        Args:
            on_drain: Called once, synchronously, when draining begins (at once if it
                already has); it must only signal the session to end (see
                ``Session``).
        """
        return Session(self, on_drain)

    # ---------------------------------------------------------- connections

    def connection_opened(self) -> None:
        """Report a connection the kernel handed over; it counts as activity.

        Call it as early as possible — when the listening socket's ``accept()`` returned,
        not when the protocol is set up — so that a drain is never declared done while
        an accepted connection is still on its way to its protocol.
        """
        self._connections += 1
        self._connections_total += 1
        if not (self._activity_from_requests and self._timing):
            self._last_activity_at = self._now()

    def connection_closed(self) -> None:
        """Report that a connection reported by ``connection_opened`` closed."""
        self._connections -= 1
        if self._draining:
            self._closed_draining += 1
        if self._zero_waiters and not self._connections:
            self._notify()

    def classify_connections(self) -> None:
        """For adapters that see requests and report each connection's first one with
        ``first_request`` from the shutdown request on: a connection opened after it
        then counts as activity only once its first request is seen and is not a probe
        (see "Probes are not traffic" in the module docs).  Once set, for good."""
        self._activity_from_requests = True

    def first_request(self, connection: object, *, probe: bool) -> None:
        """Report a request while accepting; only the first one of each ``connection``
        counts, as activity unless ``probe``.

        Args:
            connection: What identifies the request's connection while it is open
                (ASGI's ``scope["client"]``, aiohttp's transport); ``None`` if unknown:
                then every request that is not a probe counts.
            probe: The request is a health, readiness, liveness or metrics request of
                ours, or a Kubernetes probe (``is_probe``).
        """
        if not self._timing or self._draining:
            return  # only accepting watches activity
        if connection is not None:
            seen = self._first_requests
            if connection in seen:
                return
            seen.add(connection)
        if not probe:
            self.report_activity()

    def report_activity(self) -> None:
        """Report new traffic without a connection to count.

        For servers that hide their connections (or multiplex streams on one): it
        restarts *accept until idle*'s window like a new connection would.
        """
        self._last_activity_at = self._now()
        if self._zero_waiters:
            self._notify()

    # ------------------------------------------------------------ reading

    @property
    def nudging(self) -> bool:
        """``True`` while responses should tell clients to close their connection."""
        return self._nudging

    @property
    def draining(self) -> bool:
        """``True`` from the moment draining begins (including stopping and stopped)."""
        return self._draining

    @property
    def drained(self) -> bool:
        """``True`` when no connection, request or session is left."""
        if self._connections or self._requests or self._sessions:
            return False
        return not self._external_requests()[0]

    def _idle(self, include_connections: bool = True, include_requests: bool = True) -> bool:
        if self._sessions or (include_requests and self._requests):
            return False
        if include_connections and self._connections:
            return False
        return not (include_requests and self._external_requests()[0])
