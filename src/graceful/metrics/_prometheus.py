"""The one place ``prometheus_client`` is imported (``graceful-drain[metrics]``).

``prometheus-client`` is an optional extra: nothing outside ``graceful.metrics`` imports
it, and ``graceful.asgi``, ``graceful.aiohttp`` and ``graceful run`` import
``graceful.metrics`` only when a metrics endpoint is asked for.  Every module of this
package takes what it needs from here, so whichever is imported first, a missing
``prometheus_client`` is the one ``ImportError`` that says which extra to install.

``prometheus_client`` leaves some functions untyped; they are bound here to typed names
(``_MultiProcessCollector``, ``_mark_dead``, ``_go_float``) so that ``mypy --strict``
checks their callers.
"""

from __future__ import annotations

from collections.abc import Callable

try:
    from prometheus_client import Counter, Gauge, Histogram, multiprocess, values
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
        Metric,
    )
    from prometheus_client.exposition import choose_encoder
    from prometheus_client.registry import REGISTRY, Collector, CollectorRegistry
    from prometheus_client.utils import floatToGoString
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "graceful.metrics needs prometheus-client: pip install 'graceful-drain[metrics]'"
    ) from exc

__all__ = (
    "REGISTRY",
    "Collector",
    "CollectorRegistry",
    "Counter",
    "CounterMetricFamily",
    "Gauge",
    "GaugeMetricFamily",
    "Histogram",
    "HistogramMetricFamily",
    "Metric",
    "choose_encoder",
    "values",
)

# prometheus_client leaves these untyped.
_MultiProcessCollector: Callable[[CollectorRegistry | None], Collector] = (
    multiprocess.MultiProcessCollector
)
_mark_dead: Callable[[int], None] = multiprocess.mark_process_dead
_go_float: Callable[[float], str] = floatToGoString
