"""Reading the options: the command line, the environment, the gunicorn workers.

``resolve`` is the one reader: for each option in ``OPTIONS`` it takes, in order, what the
host set (``overrides``: gunicorn's ``--graceful-timeout`` is the grace period), the
command line, the ``GRACEFUL_*`` variable, a fallback variable (``UVICORN_PORT`` for
``graceful run``) and the default; parses the text with the option's parser, remembering
how it was set for the messages (``Values.label``); and finishes with ``check``.  So a
bad value fails the same way, with the same one-line ``ConfigError``, whichever way it
came in.  ``from_environment`` and ``gunicorn_values`` are its two other callers' shapes.

Under gunicorn, gunicorn owns some settings (the bind address, the number of workers,
the keep-alive timeout, …): their ``GRACEFUL_*`` variables are ignored there, with a
warning pointing at gunicorn's own flag, rather than silently overridden or refused.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Mapping
from typing import Any, Final

from ._build import check
from ._parse import ConfigError
from ._table import ENV_PREFIX, OPTIONS, _show, help_default, option
from ._values import Values

__all__ = (
    "OTHER_VARIABLES",
    "SHORT_TIMEOUT_MARGIN_DIVISOR",
    "from_environment",
    "gunicorn_values",
    "metrics_workers_warning",
    "public_prestop_warning",
    "resolve",
    "unknown_variables",
)

#: ``GRACEFUL_*`` variables that are not options: graceful's own (the demo's process
#: names, click's shell completion) and the test suite's.
OTHER_VARIABLES: Final = frozenset({
    "GRACEFUL_DEMO_NAME", "_GRACEFUL_COMPLETE", "GRACEFUL_REQUIRE_KUBERNETES",
    "GRACEFUL_ROLLOUT_RESULTS",
})  # fmt: skip


def unknown_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """One warning per ``GRACEFUL_*`` variable that is no option, naming the closest
    option's variable when there is one (``GRACEFUL_IDEL``: ``GRACEFUL_IDLE``)."""
    import difflib

    environ = os.environ if environ is None else environ
    known = {o.env for o in OPTIONS}
    suffixes = [o.name.upper() for o in OPTIONS]  # compared without the common prefix
    warnings = []
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX) or name in known or name in OTHER_VARIABLES:
            continue
        close = difflib.get_close_matches(name[len(ENV_PREFIX) :], suffixes, n=1, cutoff=0.6)
        hint = f" (did you mean {ENV_PREFIX}{close[0]}?)" if close else " (see graceful run --help)"
        warnings.append(f"{name} is not a graceful option and is ignored{hint}")
    return warnings


def public_prestop_warning(values: Values) -> str | None:
    """The warning for a preStop endpoint on the app's own port: one ``GET`` from anyone
    who can reach the app takes the pod out of rotation."""
    path = values["prestop_path"]
    if path is None or (values["management_port"] is not None and not values["health_on_app_port"]):
        return None
    return (
        f"{values.label('prestop_path')} {path} is answered on the app's port: anyone who can "
        "reach the app can take this pod out of rotation with one GET; serve it on "
        f"{values.label('management_port')}, a port the Service and the ingress do not expose"
    )


def metrics_workers_warning(
    values: Values, workers: int, environ: Mapping[str, str] | None = None
) -> str | None:
    """The warning for a metrics endpoint served by several processes without
    ``prometheus_client``'s multiprocess mode: each scrape reaches one of them."""
    environ = os.environ if environ is None else environ
    if values["metrics_path"] is None or workers < 2 or environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return None
    return (
        f"{values.label('metrics_path')} with {workers} workers and no PROMETHEUS_MULTIPROC_DIR: "
        "each scrape answers with one worker's numbers; set PROMETHEUS_MULTIPROC_DIR to an "
        "empty directory for all of them (see the metrics docs)"
    )


def resolve(
    given: Mapping[str, str] | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    overrides: Mapping[str, tuple[object, str]] | None = None,
    ignore: Collection[str] = (),
    given_as: Mapping[str, str] | None = None,
    fallback_env: Mapping[str, str] | None = None,
    unset_labels: Mapping[str, str] | None = None,
) -> Values:
    """Parse and check every option: command line first, then environment, then default.

    Args:
        given: Option name to text, from the command line.
        environ: The environment (default: ``os.environ``).
        overrides: Option name to ``(value, label)`` set by the host, winning over both
            (gunicorn's ``--graceful-timeout`` is the grace period).
        ignore: Options not read from the environment (settings the host owns).
        given_as: Option name to the label of a given option that was set under another
            name (uvicorn's ``--timeout-graceful-shutdown`` for ``--drain-timeout``).
        fallback_env: Option name to a variable read when ``GRACEFUL_*`` is not set
            (``UVICORN_PORT`` for ``graceful run``).
        unset_labels: Option name to how messages name it when it was not set (the
            Python API's names; default: the flag).

    Raises:
        ConfigError: one line, naming the option as it was set.
    """
    given = given or {}
    given_as = given_as or {}
    fallback_env = fallback_env or {}
    environ = os.environ if environ is None else environ
    overrides = overrides or {}
    values: dict[str, Any] = {}
    labels: dict[str, str] = {}
    for opt in OPTIONS:
        fallback = fallback_env.get(opt.name)
        if opt.name in overrides:
            values[opt.name], labels[opt.name] = overrides[opt.name]
            continue
        if opt.name in given:
            text, label = given[opt.name], given_as.get(opt.name, opt.flag)
        elif opt.env in environ and opt.name not in ignore:
            text, label = environ[opt.env], opt.env
        elif fallback is not None and fallback in environ and opt.name not in ignore:
            text, label = environ[fallback], fallback
        else:
            values[opt.name] = opt.default
            continue
        text = text.strip()
        if not text:
            raise ConfigError(f"{label}: must not be empty (default: {help_default(opt)})")
        try:
            values[opt.name] = opt.parse(text)
        except ValueError as exc:
            raise ConfigError(f"{label}: {exc}") from None
        labels[opt.name] = label
    result = Values(values, labels, unset_labels)
    check(result)
    return result


def from_environment(environ: Mapping[str, str] | None = None, **overrides: object) -> Values:
    """Checked values from ``GRACEFUL_*`` variables; ``overrides`` (by option name) win.

    Raises:
        ConfigError: naming the variable and what is allowed.
    """
    return resolve(
        environ=environ, overrides={k: (v, f"{k}={_show(v)}") for k, v in overrides.items()}
    )


#: Settings gunicorn owns: their GRACEFUL_* variables are ignored under gunicorn.
_GUNICORN_OWNS = frozenset(o.name for o in OPTIONS if o.gunicorn is not None)


#: Under gunicorn the default kill margin is at most this fraction of
#: ``--graceful-timeout`` (0.2 s of 2 s).
SHORT_TIMEOUT_MARGIN_DIVISOR: Final = 10


def gunicorn_values(
    graceful_timeout: float,
    environ: Mapping[str, str] | None = None,
    warn: Callable[[str], object] | None = None,
    workers: int | None = None,
) -> Values:
    """The options of a gunicorn worker (uvicorn, hypercorn, aiohttp): ``GRACEFUL_*``,
    with gunicorn's ``graceful_timeout`` as the grace period; the default kill margin is
    at most a tenth of it (with a warning when the timeout is not above twice it); the
    variables of settings gunicorn owns are ignored, with a warning, as are unknown
    ``GRACEFUL_*`` variables; with ``workers`` (gunicorn's ``--workers``) a metrics
    endpoint without multiprocess mode is warned of.

    Raises:
        ConfigError: one line naming the variable or ``--graceful-timeout``.
    """
    environ = os.environ if environ is None else environ
    grace = float(graceful_timeout)
    if grace <= 0:
        raise ConfigError(
            f"--graceful-timeout {graceful_timeout} leaves no time to drain; "
            "graceful workers need a positive one"
        )
    overrides: dict[str, tuple[object, str]] = {"grace_period": (grace, "--graceful-timeout")}
    margin = option("kill_margin")
    # The margin scales with a short timeout: at most a tenth of it (stock gunicorn
    # serves a request until the SIGKILL; a fixed second would cut what it completes).
    short = grace / SHORT_TIMEOUT_MARGIN_DIVISOR
    if margin.env not in environ and short < margin.default:
        overrides["kill_margin"] = (short, "the kill margin")
        if warn is not None and grace <= 2 * margin.default:
            warn(
                f"graceful: --graceful-timeout {grace:g} leaves no room for the default kill "
                f"margin ({margin.default:g} s): the kill margin is {short:g} s (set "
                f"{margin.env} to choose)"
            )
    if warn is not None:
        for opt in OPTIONS:
            if opt.name in _GUNICORN_OWNS and opt.env in environ:
                warn(f"graceful: {opt.env} is ignored under gunicorn (use {opt.gunicorn})")
        for text in unknown_variables(environ):
            warn(f"graceful: {text}")
    values = resolve(environ=environ, overrides=overrides, ignore=_GUNICORN_OWNS)
    if values["management_port"] is not None:  # the master answers for every worker
        if values["readiness_on_shutdown"] == "keep":
            raise ConfigError(
                f"{values.label('readiness_on_shutdown')} keep is not taken with "
                f"{values.label('management_port')} under gunicorn yet (the master does not "
                "know when its workers stop accepting): use fail"
            )
        if values["metrics_path"] is not None and not environ.get("PROMETHEUS_MULTIPROC_DIR"):
            raise ConfigError(
                f"{values.label('metrics_path')} with {values.label('management_port')} "
                "under gunicorn needs PROMETHEUS_MULTIPROC_DIR (an empty directory): the "
                "master serves every worker's metrics from it"
            )
    if warn is not None and workers is not None:
        for warning in (
            metrics_workers_warning(values, workers, environ),
            public_prestop_warning(values),
        ):
            if warning is not None:
                warn(f"graceful: {warning}")
    return values
