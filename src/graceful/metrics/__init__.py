"""Prometheus metrics of a ``graceful.ShutdownCoordinator`` (``graceful-drain[metrics]``).

::

    import graceful.metrics
    graceful.metrics.register(coordinator)            # into prometheus_client.REGISTRY
    app = graceful.metrics.asgi_app(coordinator)      # or serve /metrics yourself

``GracefulMiddleware(metrics_path="/metrics")``, ``graceful run --metrics-path /metrics``
and ``graceful.aiohttp.setup(metrics_path=…)`` serve the endpoint for you.  Every metric
starts with ``graceful_``; ``docs/metrics.md`` says what each one means.

Why a collector, and why not in multiprocess mode
-------------------------------------------------
The coordinator already counts everything on the hot path, and
``graceful.ShutdownCoordinator.statistics`` returns a snapshot of it.  So in a single
process nothing is counted twice: a custom collector reads one snapshot per scrape and
turns it into metric families.  ``statistics()`` reads the event loop's clock, so it runs
on the event-loop thread; a scrape from another thread (``prometheus_client``'s own
``start_http_server``) hands the call to the loop and waits for it.

A collector's values never reach ``prometheus_client``'s multiprocess files, though: with
``PROMETHEUS_MULTIPROC_DIR`` set (gunicorn, ``graceful run --workers``) a scrape reaches
one worker, which can only read the other workers' files.  There each process writes real
multiprocess metrics — gauges with a ``multiprocess_mode``, counters, a histogram —
refreshed from ``statistics()`` at every phase change, every ``refresh_interval_s`` while
the coordinator runs and, in the scraped process, right before the scrape.  A process
that reaches ``STOPPED`` removes its own live gauges
(``prometheus_client.multiprocess.mark_process_dead``); one that was killed needs its
parent to do it (``mark_process_dead``, gunicorn's ``child_exit`` hook).

Where things are
----------------
``_prometheus`` (the one import of ``prometheus_client``), ``_collector`` (the metrics,
the snapshot reader, the single-process collector), ``_multiprocess`` (the multiprocess
writer, ``multiprocess_mode``, ``mark_process_dead``), ``_registry`` (``register``,
``unregister``) and ``_exposition`` (``Exposition``, ``asgi_app``), each importing only
the ones before it.  Everything public is imported from here.
"""

from __future__ import annotations

from ._collector import DRAIN_DURATION_BUCKETS_S
from ._exposition import RENDER_RETRIES_S as RENDER_RETRIES_S
from ._exposition import Exposition, asgi_app
from ._exposition import every_process as every_process
from ._multiprocess import MULTIPROC_DIR_ENV, mark_process_dead, multiprocess_mode
from ._registry import register, unregister

__all__ = (
    "DRAIN_DURATION_BUCKETS_S",
    "MULTIPROC_DIR_ENV",
    "Exposition",
    "asgi_app",
    "mark_process_dead",
    "multiprocess_mode",
    "register",
    "unregister",
)
