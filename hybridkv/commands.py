"""The ``hybridkv`` subcommand registry and the argument types its commands share.

Each subcommand is one ``Command`` (a name, a help line, a function that adds its arguments and one that runs
it and returns the exit code), registered here by the module that defines it: ``cli.py`` for the built-in
ones, ``eval/cli.py`` for ``hybridkv eval``. ``cli.py`` builds the parser from ``COMMANDS`` and imports every
registering module, so imports only point down (commands <- eval/cli <- cli).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hybridkv.models.memory import check_device

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class UsageError(Exception):
    """Bad input from the user: reported as one line, exit code 2."""


@dataclass(frozen=True, kw_only=True)
class Command:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


COMMANDS: dict[str, Command] = {}


def register(command: Command) -> Command:
    if command.name in COMMANDS:
        raise ValueError(f"hybridkv subcommand {command.name!r} is already registered")
    COMMANDS[command.name] = command
    return command


def positive_int(text: str) -> int:
    """argparse type for counts (shared by every subcommand)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def device_arg(text: str) -> str:
    """argparse type for ``--device``: "auto", or a device that exists on this machine."""
    if text == "auto":
        return text
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device (cpu, cuda, cuda:1, auto)") from None
    try:
        check_device(device)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def configure_logging(level: str) -> None:
    """One stderr handler for the ``hybridkv`` loggers at ``level`` (a name of ``LOG_LEVELS``), with times."""
    import logging

    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%m-%d %H:%M:%S"))
    root = logging.getLogger("hybridkv")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
