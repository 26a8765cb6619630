"""Deterministic / batch-invariant serving and OEA: the one rule every engine adapter applies.

vLLM's batch-invariant mode (``VLLM_BATCH_INVARIANT=1``) and SGLang's deterministic inference
(``--enable-deterministic-inference``) exist so that a request's output does not depend on what it is batched
with. OEA makes exactly that dependence (a token's experts follow the batch's union), so with such a mode on the
plugin keeps the engine's routing: OEA stays off, with one warning at start-up naming both settings. It does not
refuse to start: an engine hook never takes a server down, and the user asked for determinism explicitly, which
the engine then delivers. Recording (``OEA_TRACE_FILE``) and metrics only observe and stay as asked.

Each adapter only translates its engine's flag into ``setting`` (the words naming it, or None when off) and calls
``keep_engine_routing`` at start-up and ``doctor_check`` in its doctor; the rule and its words live here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from oea.config import EnvSettings, k0_variable
from oea.config.settings import all_settings_from_env
from oea.integrations.doctor.common import Check, check

WARN_KEY = "deterministic-mode"  # the WarnOnce key: one warning per process
CHECK_NAME = "deterministic mode"  # the doctor check's name (contract: contains "deterministic")


def deterministic_message(settings: EnvSettings, setting: str) -> str:
    """The one line said when ``setting`` (the engine's deterministic mode) meets OEA's k0 variable."""
    k0 = k0_variable(settings)
    return (f"{k0} is set but {setting} is on: the engine promises that a request's output does not depend on its "
            f"batch, and OEA makes it depend on the batch, so OEA stays off and every layer keeps the engine's "
            f"routing ({k0} is ignored); unset {k0}, or turn {setting} off to serve with OEA")


def keep_engine_routing(settings: EnvSettings, setting: str | None,
                        warn: Callable[[str, str], object]) -> EnvSettings:
    """The settings a plugin serves with: ``settings`` with OEA off when ``setting`` (the engine's deterministic
    mode, None when off) is on and OEA was asked for, after one ``warn(WARN_KEY, message)``; else ``settings``.

    Call it after the settings were validated (a malformed value still stops start-up). ``OEA_LAYER_K0_FILE`` goes
    with ``OEA_K0``: without OEA the file is not used, and the file-without-``OEA_K0`` error must not fire.
    """
    if setting is None or settings.oea is None:
        return settings
    warn(WARN_KEY, deterministic_message(settings, setting))
    return replace(settings, oea=None, layer_k0_file=None)


def doctor_check(read_setting: Callable[[], str | None], how: str) -> Check:
    """The doctor's ``deterministic mode`` check: ok when the mode is off (``read_setting()`` None) or OEA is off
    anyway; failed when both are on (the server would keep the engine's routing although the environment asks for
    OEA). ``how`` says where the flag was read from (the engine's own accessor, its variable). A flag or an
    ``OEA_*`` value that cannot be read fails the check with the reader's message."""
    try:
        setting = read_setting()
        settings = all_settings_from_env()
    except ValueError as err:  # the message names the variable
        return check(CHECK_NAME, False, str(err))
    if setting is None:
        return check(CHECK_NAME, True, f"off ({how}): OEA applies as configured")
    if settings.oea is not None:
        return check(CHECK_NAME, False, f"OEA will stay off because of {setting} ({how}): "
                                        f"{deterministic_message(settings, setting)}")
    return check(CHECK_NAME, True, f"{setting} is on ({how}): OEA stays off (OEA_K0 unset; setting it would not "
                                   f"turn OEA on while {setting})")
