"""A one-file Django project for the WSGI worker tests (settings configured here)."""

from __future__ import annotations

import time

import django
from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.urls import path

settings.configure(
    DEBUG=False,
    ALLOWED_HOSTS=["*"],
    ROOT_URLCONF=__name__,
    SECRET_KEY="tests-only",
    MIDDLEWARE=[],
    INSTALLED_APPS=[],
)
django.setup()


def index(request: HttpRequest) -> HttpResponse:
    return HttpResponse(f"hello from {request.GET.get('id', '-')}\n")


def slow(request: HttpRequest) -> HttpResponse:
    seconds = float(request.GET.get("s", "1"))
    print(f"slow request started {request.GET.get('id', '-')}", flush=True)
    time.sleep(seconds)  # the behaviour under test: a request that takes this long
    return HttpResponse(f"slow done after {seconds:g} s\n")


urlpatterns = [path("", index), path("slow", slow)]

from django.core.wsgi import get_wsgi_application  # noqa: E402

application = get_wsgi_application()
