"""A griffe extension for the docs build: read the docstrings' bits of reST as Markdown.

The package's docstrings use Sphinx-style roles (``:class:`~a.B```), shown here as inline
code, and end a paragraph with ``::`` before an indented literal block, shown as ``:``
(the block itself is already a Markdown code block). Markdown would print both verbatim.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|data|exc|mod|obj):`(~?)([^`]+)`")
_LITERAL = re.compile(r"(?<=\S)::$", re.MULTILINE)


def _code(match: re.Match[str]) -> str:
    target = match.group(2)
    return f"`{target.rsplit('.', 1)[-1] if match.group(1) else target}`"


class RstRoles(griffe.Extension):
    """Rewrites each docstring's roles when griffe loads the object."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _LITERAL.sub(":", _ROLE.sub(_code, obj.docstring.value))
