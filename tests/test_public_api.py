"""Keeps ``graceful.__all__`` honest (after trio's and anyio's export tests)."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys

import pytest

import graceful

PUBLIC_MODULES = [
    "graceful",
    "graceful.aiohttp",
    "graceful.asgi",
    "graceful.asyncio",
    "graceful.granian",
    "graceful.gunicorn",
    "graceful.hypercorn",
    "graceful.metrics",
    "graceful.uvicorn",
]


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_all_is_a_sorted_tuple_of_existing_names(module_name: str) -> None:
    module = importlib.import_module(module_name)
    assert isinstance(module.__all__, tuple)
    assert list(module.__all__) == sorted(module.__all__, key=lambda n: (not n.isupper(), n))
    assert len(set(module.__all__)) == len(module.__all__)
    for name in module.__all__:
        assert hasattr(module, name), name


def test_every_public_name_is_exported() -> None:
    public = {
        name
        for name, value in vars(graceful).items()
        if not name.startswith("_") and not inspect.ismodule(value) and name != "annotations"
    }
    assert public == set(graceful.__all__)


def test_exported_objects_live_in_private_modules() -> None:
    for name in graceful.__all__:
        obj = getattr(graceful, name)
        module = getattr(obj, "__module__", None)
        if module is not None:
            assert module.startswith("graceful._"), (name, module)


def test_concrete_classes_are_final() -> None:
    for name in graceful.__all__:
        obj = getattr(graceful, name)
        if inspect.isclass(obj) and not inspect.isabstract(obj) and obj is not graceful.Phase:
            assert getattr(obj, "__final__", False), f"{name} should be @final"


def test_import_graceful_needs_only_anyio() -> None:
    code = (
        "import sys, graceful; "
        "bad = {'uvicorn', 'gunicorn', 'hypercorn', 'aiohttp', 'starlette', 'trio', "
        "'prometheus_client'} "
        "& set(sys.modules); print(sorted(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
