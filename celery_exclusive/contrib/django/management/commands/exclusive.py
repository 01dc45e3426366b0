"""``manage.py exclusive [--url URL] [--prefix P] list|show|release|doctor``: the operator CLI.

The lock store is ``--url``, else the ``CELERY_EXCLUSIVE_URL`` setting (the ``CELERY_``
namespace Celery reads Django settings with), else the ``CELERY_EXCLUSIVE_URL`` environment
variable; the prefix likewise from ``CELERY_EXCLUSIVE_PREFIX``. Exit codes are the CLI's.
"""

from __future__ import annotations

import argparse
import copy
import os
from types import SimpleNamespace
from typing import Any

import click
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from celery_exclusive.cli import exclusive


def _conf() -> dict[str, Any]:
    """The Django settings Celery would read as ``exclusive_url`` and ``exclusive_prefix``."""
    conf = {
        "exclusive_url": getattr(settings, "CELERY_EXCLUSIVE_URL", None),
        "exclusive_prefix": getattr(settings, "CELERY_EXCLUSIVE_PREFIX", None),
        "broker_url": getattr(settings, "CELERY_BROKER_URL", None),
    }
    return {k: v for k, v in conf.items() if v is not None}


def _for_django(text: str | None) -> str | None:
    """Help text that names the Django settings where the Celery group names app.conf."""
    if text is None:
        return None
    for name in ("url", "prefix"):
        text = text.replace(f"app.conf.exclusive_{name}", f"settings.CELERY_EXCLUSIVE_{name.upper()}")
    return text.replace("the app's exclusive_url", "settings.CELERY_EXCLUSIVE_URL")


def _group() -> click.Group:
    """The CLI's ``exclusive`` group, its help naming Django's settings (the commands are shared)."""
    group = copy.copy(exclusive)
    group.help = _for_django(exclusive.help)
    group.params = []
    for original in exclusive.params:
        param = copy.copy(original)
        if isinstance(param, click.Option):
            param.help = _for_django(param.help)
        group.params.append(param)
    return group


def run(args: list[str], prog_name: str) -> int:
    """Run the CLI's ``exclusive`` group on ``args``; its exit code."""
    obj = SimpleNamespace(app=SimpleNamespace(conf=_conf()))
    try:
        _group().main(args=args, prog_name=prog_name, obj=obj, standalone_mode=True)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)


class Command(BaseCommand):  # type: ignore[misc]  # Django ships no type hints
    help = "Inspect and manage celery-exclusive leases (list, show, release, doctor); see --help."

    def run_from_argv(self, argv: list[str]) -> None:
        # Click parses everything after "exclusive", so its --help and options are the CLI's own.
        raise SystemExit(run(argv[2:], f"{os.path.basename(argv[0])} {argv[1]}"))

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("args", nargs="*", help="the celery-exclusive command line")

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> argparse.ArgumentParser:
        # call_command() parses its args here: hand all of them to Click, options included.
        parser: argparse.ArgumentParser = super().create_parser(prog_name, subcommand, **kwargs)
        defaults = parser.parse_args

        def parse_args(args: Any = None, namespace: Any = None) -> argparse.Namespace:
            parsed: argparse.Namespace = defaults([], namespace)
            parsed.args = [str(a) for a in args or ()]
            return parsed

        parser.parse_args = parse_args  # type: ignore[method-assign,assignment]
        return parser

    def handle(self, *args: str, **options: Any) -> None:
        code = run(list(args), "manage.py exclusive")
        if code:
            raise CommandError(f"exclusive {' '.join(args)} exited with status {code}", returncode=code)
