"""The docs stay true: the generated configuration page is current, the API page lists
every public name, and every code block is an included example or is checked here."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import itertools
import json
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from graceful import _options as _config
from graceful._cli import run as _run

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
#: The pages whose code blocks must be included examples or checked here: every page
#: (docs/reliability.md, written by tests/faults/render.py, has tables and no code block).
CHECKED_PAGES = tuple(sorted(page.name for page in DOCS.glob("*.md")))
#: The public modules, each documented on the API page with its ``__all__``.
PUBLIC_MODULES = (
    "graceful",
    "graceful.asgi",
    "graceful.uvicorn",
    "graceful.asyncio",
    "graceful.hypercorn",
    "graceful.granian",
    "graceful.aiohttp",
    "graceful.gunicorn",
    "graceful.metrics",
    "graceful.wsgi",
)
#: Languages of blocks that are output or synopses, not something to run.
NOT_CODE = {"text"}
#: Languages of blocks that are not included but checked here: shell commands (parsed),
#: event lines (read back as events), Prometheus queries (the metrics exist).
CHECKED_HERE = {"bash", "json", "promql"}

SNIPPET = re.compile(r'^\s*-{1,}8<-{1,}\s+"([^"]+)"\s*$', re.MULTILINE)
#: A fenced block, at the start of a line or indented in a list item.
FENCE = re.compile(r"^( *)```(\w*)\n(.*?)^\1```$", re.MULTILINE | re.DOTALL)


def _generator() -> ModuleType:
    path = ROOT / "tools" / "gen_configuration.py"
    spec = importlib.util.spec_from_file_location("gen_configuration", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_configuration_page_is_generated_from_the_declarations() -> None:
    generator = _generator()
    committed = (DOCS / "configuration.md").read_text()
    assert committed == generator.render(), (
        f"docs/configuration.md is out of date; regenerate it: {generator.COMMAND}"
    )


def test_configuration_page_names_every_option() -> None:
    page = (DOCS / "configuration.md").read_text()
    for opt in _config.OPTIONS:
        assert f"`{opt.env}`" in page
        assert f"`{opt.flag}" in page


def test_api_page_documents_every_public_name() -> None:
    page = (DOCS / "api.md").read_text()
    blocks = dict(
        re.findall(r"^::: ([\w.]+)\n    options:\n      members: \[([^\]]*)\]", page, re.M)
    )
    assert sorted(blocks) == sorted(PUBLIC_MODULES)
    for name, members in blocks.items():
        exported = importlib.import_module(name).__all__
        assert [m.strip() for m in members.split(",")] == list(exported), name


def _blocks() -> Iterator[tuple[str, str, str]]:
    for page in CHECKED_PAGES:
        for _, language, body in FENCE.findall((DOCS / page).read_text()):
            yield page, language, body


def test_every_page_is_checked_and_every_fence_is_a_block() -> None:
    assert "index.md" in CHECKED_PAGES
    assert len(CHECKED_PAGES) == len(list(DOCS.glob("*.md")))
    for page in CHECKED_PAGES:
        text = (DOCS / page).read_text()
        fences = re.findall(r"^ *```", text, re.MULTILINE)
        assert len(fences) == 2 * len(FENCE.findall(text)), f"docs/{page}: unmatched fence"


def _includes(text: str) -> list[str]:
    return SNIPPET.findall(text)


@pytest.mark.parametrize("page", CHECKED_PAGES)
def test_included_files_and_sections_exist(page: str) -> None:
    for target in _includes((DOCS / page).read_text()):
        path, _, section = target.partition(":")
        text = (ROOT / path).read_text()
        if section:
            assert f"--8<-- [start:{section}]" in text, target
            assert f"--8<-- [end:{section}]" in text, target


def test_code_blocks_are_included_or_checked() -> None:
    for page, language, body in _blocks():
        if language in NOT_CODE or _includes(body):
            continue
        assert language in CHECKED_HERE, (
            f"docs/{page}: a {language or 'plain'} code block that is not included from "
            'examples/ (use --8<-- "examples/FILE:SECTION")'
        )


def test_event_lines_are_events() -> None:
    from graceful._core.events import parse_event

    checked = 0
    for page, language, body in _blocks():
        if language == "json":
            for line in body.splitlines():
                assert parse_event(line) is not None, f"docs/{page}: {line}"
                checked += 1
    assert checked >= 1


def test_prometheus_queries_name_existing_metrics() -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    import graceful.metrics

    collector = graceful.metrics.register(
        graceful.ShutdownCoordinator(), prometheus_client.CollectorRegistry()
    )
    suffixes = {"counter": ["_total"], "gauge": [""], "histogram": ["_bucket", "_sum", "_count"]}
    samples = {
        family.name + suffix for family in collector.describe() for suffix in suffixes[family.type]
    }
    checked = 0
    for page, language, body in _blocks():
        if language == "promql":
            for name in re.findall(r"\bgraceful_\w+", body):
                assert name in samples, f"docs/{page}: no metric {name}"
                checked += 1
    assert checked >= 4


def _commands() -> Iterator[tuple[str, list[str]]]:
    """Every shell command of the pages' bash blocks, as words."""
    for page, language, body in _blocks():
        if language != "bash" or _includes(body):
            continue
        for line in body.replace("\\\n", " ").splitlines():
            line = line.split("#", 1)[0].strip()  # only "  # comment" lines have a #
            if line:
                for command in line.split("&&"):
                    yield page, shlex.split(command)


def _split_environment(words: list[str]) -> tuple[dict[str, str], list[str]]:
    environ = {}
    while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
        name, _, value = words.pop(0).partition("=")
        environ[name] = value
    return environ, words


def _check_graceful_run(arguments: list[str], environ: dict[str, str]) -> None:
    if arguments[:1] == ["MODULE:APP"]:  # the synopsis
        return
    with pytest.MonkeyPatch.context() as patch:
        for name in [n for n in _config.os.environ if n.startswith(_config.ENV_PREFIX)]:
            patch.delenv(name)
        for name, value in environ.items():
            patch.setenv(name, value)
        with contextlib.suppress(_run.HelpShown):  # --help, --version print and stop
            _run.parse(arguments)  # raises ConfigError naming the bad option


def _check_gunicorn(arguments: list[str], environ: dict[str, str]) -> None:
    timeout = 30.0
    for flag, value in itertools.pairwise(arguments):
        if flag == "-k":
            module, _, name = value.rpartition(".")
            assert hasattr(importlib.import_module(module), name), value
        elif flag == "-c":
            assert (ROOT / value).is_file(), value
        elif flag == "--graceful-timeout":
            timeout = float(value)
    _config.gunicorn_values(timeout, environ)


def test_shell_commands_are_valid() -> None:
    """``graceful run`` options and ``GRACEFUL_*`` values parse, gunicorn's worker classes
    exist, pip extras are declared."""
    try:
        import tomllib
    except ImportError:  # Python 3.10: the extras are not checked
        extras = None
    else:
        pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
        extras = pyproject["project"]["optional-dependencies"]
    checked = 0
    for page, words in _commands():
        environ, words = _split_environment(words)
        try:
            if words[:2] == ["graceful", "run"]:
                _check_graceful_run(words[2:], environ)
            elif words[:3] == ["python", "-m", "graceful"] and words[3:4] == ["run"]:
                _check_graceful_run(words[4:], environ)
            elif words[:1] == ["gunicorn"]:
                _check_gunicorn(words[1:], environ)
            elif words[:2] == ["pip", "install"]:
                for word in words[2:]:
                    match = re.fullmatch(r"graceful-drain\[([\w,]+)\]", word)
                    if match and extras is not None:
                        assert set(match[1].split(",")) <= set(extras), word
            else:
                continue
        except (_config.ConfigError, AssertionError, ValueError, ImportError) as exc:
            pytest.fail(f"docs/{page}: {shlex.join(words)}: {exc}")
        checked += 1
    assert checked >= 5


def test_kubernetes_example_is_valid() -> None:
    yaml = pytest.importorskip("yaml")
    manifest = yaml.safe_load((ROOT / "examples" / "kubernetes" / "deployment.yaml").read_text())
    pod = manifest["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    environ = {item["name"]: str(item["value"]) for item in container["env"] if "value" in item}
    downward = {
        item["name"]: item["valueFrom"]["fieldRef"]["fieldPath"]
        for item in container["env"]
        if "valueFrom" in item
    }
    assert downward == {"POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace"}
    assert container["command"][:2] == ["graceful", "run"]
    _check_graceful_run(container["command"][2:], environ)
    assert _config.boolean(environ["GRACEFUL_KUBERNETES"])
    # The fallback if the API cannot be read: the pod's own grace period.
    assert float(environ["GRACEFUL_GRACE_PERIOD"]) == pod["terminationGracePeriodSeconds"]
    # No preStop sleep: the preStop hook, if any, is graceful's endpoint (it drains).
    prestop = container.get("lifecycle", {}).get("preStop")
    if prestop is not None:
        assert "exec" not in prestop, prestop
        get = prestop["httpGet"]
        assert (get["path"], get["port"]) == (environ["GRACEFUL_PRESTOP_PATH"], "management")
    # The service account the Role is bound to.
    rbac = list(yaml.safe_load_all((ROOT / "examples" / "kubernetes" / "rbac.yaml").read_text()))
    (binding,) = (doc for doc in rbac if doc["kind"] == "RoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": pod["serviceAccountName"]}]
    assert (
        container["readinessProbe"]["httpGet"]["path"] == _config.option("readiness_path").default
    )
    assert container["livenessProbe"]["httpGet"]["path"] == _config.option("liveness_path").default
    # The probes on the management port, the Service on the app's only.
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports["management"] == int(environ["GRACEFUL_MANAGEMENT_PORT"]) != ports["http"]
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["port"] == "management"
    service = yaml.safe_load((ROOT / "examples" / "kubernetes" / "service.yaml").read_text())
    assert [port["targetPort"] for port in service["spec"]["ports"]] == ["http"]


def _deployment_commands() -> Iterator[tuple[str, list[str]]]:
    """The ``graceful run`` command of each file in examples/deploy/."""
    deploy = ROOT / "examples" / "deploy"
    for path in sorted(deploy.iterdir()):
        for line in path.read_text().splitlines():
            if not re.match(r"\s*(CMD|ExecStart=|command\s*[=:])", line):
                continue
            if "[" in line and '"run"' in line:  # an exec-form array
                words = json.loads(line[line.index("[") : line.rindex("]") + 1])
            elif "graceful run" in line:
                words = shlex.split(line.split("=", 1)[-1])
            else:
                continue
            start = next(i for i, w in enumerate(words) if w.endswith("graceful"))
            yield path.name, words[start + 2 :]


def test_deployment_examples_parse() -> None:
    """The Dockerfile, systemd unit, supervisord and Compose files docs/deployment.md
    includes: each one's ``graceful run`` command parses, with a grace period."""
    found = {}
    for name, arguments in _deployment_commands():
        found[name] = _run.parse(arguments, {})
        assert found[name].values.given("grace_period"), name
    assert sorted(found) == ["Dockerfile", "compose.yaml", "graceful.service", "supervisord.conf"]
