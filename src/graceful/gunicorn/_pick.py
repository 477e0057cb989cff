"""``graceful.gunicorn.WSGIWorker``: one ``-k`` name for every ``--threads``.

gunicorn replaces a worker class named ``…SyncWorker`` by its stock ``gthread`` before
importing it when ``--threads`` is above 1 (a match on the name), so no code of
graceful's would run; a name without that suffix is left alone.  ``WSGIWorker.__new__``
returns an instance of the class picked, so the worker gunicorn runs is a plain
``SyncWorker`` or ``ThreadWorker``.
"""

from __future__ import annotations

from typing import Any

from gunicorn.workers.sync import SyncWorker as _StockSyncWorker

from ._sync import SyncWorker
from ._thread import ThreadWorker


class WSGIWorker(_StockSyncWorker):  # type: ignore[misc]
    """``-k graceful.gunicorn.WSGIWorker``: ``SyncWorker`` with ``--threads 1`` (the
    default), ``ThreadWorker`` with more — one name for every ``--threads``.  gunicorn
    replaces a class named ``…SyncWorker`` by its stock ``gthread`` when ``--threads`` is
    above 1; this name it leaves alone.  Instances are of the class picked."""

    @staticmethod
    def picked(cfg: Any) -> type[SyncWorker] | type[ThreadWorker]:
        """The worker class for gunicorn's configuration ``cfg``."""
        return ThreadWorker if int(cfg.threads) > 1 else SyncWorker

    @classmethod
    def check_config(cls, cfg: Any, log: Any) -> None:
        cls.picked(cfg).check_config(cfg, log)

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        cfg = kwargs["cfg"] if "cfg" in kwargs else args[5]  # gunicorn's Worker signature
        return cls.picked(cfg)(*args, **kwargs)
