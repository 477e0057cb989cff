"""Every ``graceful run`` option, declared once.

Why one table
-------------
The same settings reach graceful in three ways: ``graceful run --idle 2``,
``GRACEFUL_IDLE=2`` (for ``graceful run`` and for the gunicorn workers, which have no
command line of their own) and the defaults printed by ``--help``.  Written out three
times they drift: a variable the gunicorn worker forgot, a ``--help`` that says
"default None" where the policy really waits 2 s, a check that one path has and the
other lacks.  So each option is one ``Option`` in ``OPTIONS`` — its name (which
gives both the flag and the variable), a parser from text to value, the default, a line
of help and *where the value goes*: the policy, the coordinator, the middleware, uvicorn's
``Config`` or ``graceful run`` itself.  The argument parser, the environment reader, the
gunicorn workers, the help text and ``graceful.uvicorn.build_server`` are all generated from it, so
adding an option is adding one entry.

uvicorn's own options (``--reload``, ``--uds``, ``--ssl-*``, …) are not declared here:
``graceful run`` takes them from uvicorn's command line definition (see
``graceful._cli.command``).  An option declared here that uvicorn has too wins over uvicorn's.

Values are checked twice: each on its own by its parser (a wrong type, NaN, a negative or
absurdly large number, an empty string, an unknown choice), then together by
``check``, which builds the policy, the coordinator and the middleware once — so
whatever they validate is validated here, before a server or a worker starts — and adds
the checks between options (``--grace-period`` must exceed ``--kill-margin``, the health
endpoints need distinct paths).  Every failure is one ``ConfigError`` line that
names the option the way the user set it: ``--idle`` or ``GRACEFUL_IDLE``.

Where things are
----------------
``_parse`` (the parsers, ``ConfigError``), ``_table`` (``Option``, ``OPTIONS``,
``help_default``), ``_values`` (``Values``), ``_build`` (the targets' keyword arguments,
``build_coordinator``, ``check``), ``_resolve`` (``resolve``, ``from_environment``,
``gunicorn_values``, the warnings about variables) and ``_python`` (the run functions'
keyword arguments), each importing only the ones before it.  Callers import from here,
``graceful._options``; the names outside ``__all__`` are re-exported as ``name as name``
because callers use them too (the parsers, ``_named`` in ``graceful.uvicorn``, ``os`` in
the tests, which read ``_options.os.environ`` as they did of the single module).
"""

from __future__ import annotations

import os as os

from ._build import _named as _named
from ._build import (
    answered_by_parent,
    build_coordinator,
    check,
    coordinator_kwargs,
    middleware_kwargs,
    policy_kwargs,
    uvicorn_kwargs,
)
from ._parse import MAX_SECONDS, ConfigError, boolean
from ._parse import choice as choice
from ._parse import endpoint_path as endpoint_path
from ._parse import host as host
from ._parse import integer as integer
from ._parse import policy_name as policy_name
from ._parse import seconds as seconds
from ._parse import uvicorn_choice as uvicorn_choice
from ._python import PYTHON_RUN_OPTIONS as PYTHON_RUN_OPTIONS
from ._python import PYTHON_TARGETS as PYTHON_TARGETS
from ._python import python_options, python_setup, split_python, unexpected_keyword
from ._resolve import OTHER_VARIABLES as OTHER_VARIABLES
from ._resolve import SHORT_TIMEOUT_MARGIN_DIVISOR as SHORT_TIMEOUT_MARGIN_DIVISOR
from ._resolve import (
    from_environment,
    gunicorn_values,
    metrics_workers_warning,
    public_prestop_warning,
    resolve,
    unknown_variables,
)
from ._table import ENV_PREFIX, OPTIONS, SERVER_LOOPS, SERVERS, Option, help_default, option
from ._table import Target as Target
from ._values import Values

__all__ = (
    "ENV_PREFIX",
    "MAX_SECONDS",
    "OPTIONS",
    "SERVERS",
    "SERVER_LOOPS",
    "ConfigError",
    "Option",
    "Values",
    "boolean",
    "answered_by_parent",
    "build_coordinator",
    "check",
    "coordinator_kwargs",
    "from_environment",
    "gunicorn_values",
    "help_default",
    "metrics_workers_warning",
    "public_prestop_warning",
    "middleware_kwargs",
    "option",
    "policy_kwargs",
    "python_options",
    "python_setup",
    "resolve",
    "split_python",
    "unexpected_keyword",
    "unknown_variables",
    "uvicorn_kwargs",
)
