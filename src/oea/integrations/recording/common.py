"""What both engines' ``recording.py`` share around the recorder: whether this rank's file can be written at
start-up and the sidecar's description of a recording."""

from __future__ import annotations

import logging
import os
from typing import Any

from oea.config import TraceSettings
from oea.integrations.recording.recorder import rank_path, trace_path_problem
from oea.integrations.runtime import process_rank
from oea.routing import OEAConfig


def writable_settings(settings: TraceSettings | None, log: logging.Logger) -> TraceSettings | None:
    """``settings`` when this rank's file (``rank_path``) can be written, else None with one warning: serving goes
    on without recording."""
    if settings is None:
        return None
    problem = trace_path_problem(rank_path(settings.path, process_rank()))
    if problem is None:
        return settings
    log.warning("oea: OEA_TRACE_FILE=%s cannot be written (%s); serving without recording", settings.path, problem)
    return None


def recording_meta(path: str, engine: str, model: str, cfg: OEAConfig | None, settings: TraceSettings,
                   notes: list[str]) -> dict[str, Any]:
    """The sidecar's description of a recording from ``engine`` (``"a vLLM 0.32 server"``), with the engine's own
    ``notes`` (what a recorded step is, where positions and step ids come from)."""
    state = f"on (OEA_K0={cfg.k0})" if cfg is not None else "off (observe mode)"
    return {
        "name": os.path.basename(path).removesuffix(".safetensors"),
        "model": model,
        "source": f"recorded from {engine} by the oea plugin (OEA_TRACE_FILE)",
        "licence": "not stated (recorded from the server's own traffic)",
        "kind": "engine decode steps",
        "notes": [
            notes[0],
            f"OEA was {state} while recording; the router's logits are recorded before any rewrite, so every "
            "policy replays from them",
            *notes[1:],
            f"OEA_TRACE_SAMPLE={settings.sample:g}: that share of decode steps, drawn at random",
        ],
    }
