"""gunicorn settings for graceful workers that publish Prometheus metrics.

    export PROMETHEUS_MULTIPROC_DIR=/tmp/metrics GRACEFUL_METRICS_PATH=/metrics
    gunicorn -c examples/gunicorn_multiprocess.conf.py examples.asgi_app:app

``PROMETHEUS_MULTIPROC_DIR`` must name an empty directory in the environment of the
whole server, before it starts; ``/metrics`` then serves the sum over the workers.
"""

# --8<-- [start:child_exit]
import graceful.metrics


def child_exit(server, worker):
    graceful.metrics.mark_process_dead(worker.pid)


# --8<-- [end:child_exit]

worker_class = "graceful.gunicorn.UvicornWorker"
bind = "0.0.0.0:8000"
workers = 2
graceful_timeout = 30
