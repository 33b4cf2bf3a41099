"""The benchmarks' shared flags: ``--device`` (a device this machine has), ``--set KEY=VALUE`` (a hylo option) and
``--variant NAME KEY=VALUE ...`` (another hylo run, named)."""

from __future__ import annotations

import argparse
import ast
from collections.abc import Sequence
from typing import Any

import torch


def device(text: str) -> torch.device:
    """A device to run on (``cpu``, ``cuda``, ``cuda:N``), refused when this machine has no such device."""
    try:
        value = torch.device(text)
    except RuntimeError as err:
        raise argparse.ArgumentTypeError(f"not a device: {text!r} ({err})") from err
    if value.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"a benchmark runs on 'cpu' or 'cuda', got {text!r}")
    if value.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"{text}: no CUDA device is available on this machine")
        if value.index is not None and value.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"{text}: this machine has {torch.cuda.device_count()} CUDA devices")
    return value


def default_device() -> str:
    """``--device``'s default: ``cuda`` when available, else ``cpu``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def add_device(parser: argparse.ArgumentParser, text: str = "cpu or cuda[:N] (default: cuda if any)") -> None:
    """A benchmark's ``--device`` flag (:func:`device`, default :func:`default_device`), with help ``text``."""
    parser.add_argument("--device", type=device, default=default_device(), help=text)


def hylo_option(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` of a ``--set`` flag: a hylo option and its value as a Python literal (else the text itself)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def add_variant_flag(parser: argparse.ArgumentParser, help: str) -> None:  # noqa: A002
    """``--variant NAME KEY=VALUE ...`` (repeatable): another hylo run, named, with these options (read them with
    :func:`parse_variants`)."""
    parser.add_argument("--variant", nargs="+", action="append", default=[], metavar="NAME KEY=VALUE", help=help)


def parse_variants(given: Sequence[Sequence[str]]) -> dict[str, dict[str, Any]]:
    """``--variant`` arguments as {name: options}; a name given twice, or not a word, is a ValueError."""
    variants: dict[str, dict[str, Any]] = {}
    for name, *settings in given:
        if not name.replace("_", "").isalnum():
            raise ValueError(f"--variant {name!r}: a name of letters, digits and _ comes first")
        if name in variants:
            raise ValueError(f"--variant {name!r} given twice")
        variants[name] = dict(hylo_option(setting) for setting in settings)
    return variants
