"""A griffe extension for the docs build: show reST roles (``:class:`~a.B```) as inline code.

The package's docstrings use Sphinx-style roles, which Markdown would print verbatim.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|data|exc|mod|obj):`(~?)([^`]+)`")


def _code(match: re.Match[str]) -> str:
    target = match.group(2)
    return f"`{target.rsplit('.', 1)[-1] if match.group(1) else target}`"


class RstRoles(griffe.Extension):
    """Rewrites each docstring's roles when griffe loads the object."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(_code, obj.docstring.value)
