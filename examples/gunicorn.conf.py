"""gunicorn settings for graceful uvicorn workers.

    gunicorn -c examples/gunicorn.conf.py examples.asgi_app:app

gunicorn reads this file in the master, before any worker starts, so the ``GRACEFUL_*``
defaults set here reach the master's check (a bad value stops gunicorn at once) and every
worker; variables set in the deployment's environment win over them.
"""

import os

# --8<-- [start:settings]
worker_class = "graceful.gunicorn.UvicornWorker"  # UvicornH11Worker: pure Python, asyncio
bind = "0.0.0.0:8000"
workers = 2
# The kill deadline: the master SIGKILLs workers this long after SIGTERM.  In Kubernetes,
# terminationGracePeriodSeconds (or a little less).
graceful_timeout = 30
keepalive = 5

os.environ.setdefault("GRACEFUL_POLICY", "accept-until-idle")
os.environ.setdefault("GRACEFUL_IDLE", "2")
os.environ.setdefault("GRACEFUL_MAX_WAIT", "20")
# --8<-- [end:settings]
