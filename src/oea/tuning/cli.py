"""``oea calibrate`` (``calibrate_cli``), ``oea compare`` and ``oea compare-quality`` (``compare_cli``)."""

from __future__ import annotations

import argparse

from oea.tuning import calibrate_cli, compare_cli


def register(commands: argparse._SubParsersAction, bench: argparse._SubParsersAction) -> None:
    calibrate_cli.register(commands)
    compare_cli.register(commands)
