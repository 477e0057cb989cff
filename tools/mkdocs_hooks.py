"""MkDocs hooks for the API reference.

The docstrings are written for readers of the source and for ``help()``, with Sphinx
roles (``:class:`ShutdownCoordinator```); mkdocstrings renders Google-style Markdown and
would print the role itself.  This hook drops the role and keeps the code span.
"""

from __future__ import annotations

import re
from typing import Any

_ROLE = re.compile(r":(?:py:)?(?:mod|class|func|meth|attr|data|exc|obj|const):(?=<code>)")


def on_page_content(html: str, **kwargs: Any) -> str:
    """Remove Sphinx role prefixes in front of code spans."""
    return _ROLE.sub("", html)
