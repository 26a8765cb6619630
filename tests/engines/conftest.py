"""How the engine tests are spread over pytest-xdist workers, and the live SGLang servers of the
``test_sglang_server*`` modules, started once for all of them.

``make test`` runs the engine tests in one process; with ``ENGINE_XDIST="-n 2 --dist loadscope"`` they run in two
xdist workers, one per engine (``tests/conftest.py``'s scheduler):
every test of one engine runs in the same worker, in collection order, so a session fixture (``sglang_servers``)
starts once and modules never race for it; the vLLM and SGLang tests run beside each other, which fills the core
that a server serving alone leaves idle. How many servers run at once across both is bounded by the server slots
of ``server_harness`` (memory). Outside xdist nothing changes.

``sglang_servers`` (session scope) starts every server the modules of the session need together
(``sglang_server.server_arms``: the embedded model OEA off / ``OEA_K0`` = top_k / ``OEA_K0=3`` with its trace
and metrics file / ``SGLANG_OEA_K0=3`` / ``OEA_K0=9`` / a bad ``OEA_K0``, and a tiny GLM-4.5-MoE checkpoint
off / k0 = top_k / k0 = 2 for the sigmoid module), so their start-ups overlap once instead of once per module,
and one ``OEA_K0=3`` server serves both the behaviour and the recording checks. They are launched
(``sglang_launched``) at the first test of the SGLang modules that only run check scripts (``START_BESIDE``), so
that they start on the core those leave idle, and waited for by the first test that uses them. The servers are
stopped by their process groups right after the last test that uses them (``pytest_runtest_teardown``), on
SIGTERM (``server_harness.stopping_servers``), and at the end of the session in any case.

``sglang_k0_3_served`` sends the ``OEA_K0=3`` server all its traffic (two rounds of the 16 prompts together, two
prompts together, then three prompts one at a time; routed experts returned for all but the last), stops it
(SIGTERM: the recorder finishes its trace) and hands the tests what it answered and left: answers, metrics rows,
trace, log.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from server_harness import SGLANG_SLOTS, ServerSlots, stopping_servers

# The order each engine's worker runs its modules in (any other module last, in collection order): the modules
# whose servers fit beside the other engine's (server slots) run while it runs its own; the vLLM modules that
# start many servers run while SGLang's worker runs check scripts, which start none.
MODULE_ORDER = {
    "vllm": ("test_vllm_inflated", "test_vllm_recording_server", "test_vllm_plugin_hooks", "test_vllm_placement",
             "test_cuda_release_targets", "test_vllm_server", "test_vllm_speculative", "test_vllm_parallel",
             "test_vllm_soak"),
    "sglang": ("test_sglang_soak", "test_sglang_doctor", "test_sglang_metrics", "test_sglang_padding",
               "test_sglang_placement", "test_sglang_recording", "test_sglang_routing", "test_sglang_verify",
               "test_sglang_server", "test_sglang_eval_serve", "test_sglang_server_recording",
               "test_sglang_server_sigmoid"),
}
SERVERS_FIXTURE = "sglang_servers"
# The SGLang modules that start no server (each test runs a check script in .venv-sglang, on one core): the shared
# servers start beside them (``_shared_servers_start_beside_checks``). Measured alone on the quiet 2-core machine:
# these modules take 158 s at 50% of the CPU, the shared servers' start-up 162 s on both cores.
START_BESIDE = frozenset({"test_sglang_doctor", "test_sglang_metrics", "test_sglang_padding", "test_sglang_placement",
                          "test_sglang_recording", "test_sglang_routing", "test_sglang_verify"})
# The shared servers' priority (their sessions' autogroups too: each server leads a session of its own, and the
# kernel shares the CPU between autogroups first): a check script beside their start-ups keeps its core, and the
# servers take what it leaves. At nice 0 the eight start-ups took the cores from the check scripts (the three
# doctor tests 177 s against 30 s alone) and the overlap gained nothing.
SHARED_NICE = 10
_LIVE: dict[str, Any] = {}  # the started servers (name -> sglang_server.Live), while they run
_SLOTS: list[ServerSlots] = []  # their server slots, freed when they stop


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """One engine's modules after the other's, each engine's in ``MODULE_ORDER`` (a stable sort: the tests of a
    module stay together and in order; the other tests of the run keep their places before the engine tests).
    Engine by engine, so that in one process (``make test``) the shared SGLang servers, which live from their
    first module to their last, are never up beside a vLLM module's servers (memory); in two xdist workers each
    worker holds one engine's tests and the order within it is ``MODULE_ORDER``'s."""
    order = {name: (engine, rank) for engine, names in enumerate(MODULE_ORDER.values())
             for rank, name in enumerate(names)}

    def rank(item: pytest.Item) -> tuple[int, int, int]:
        module = getattr(getattr(item, "module", None), "__name__", "")
        if "/tests/engines/" not in f"/{item.nodeid}":
            return (0, 0, 0)
        return (1, *order.get(module.rsplit(".", 1)[-1], (len(MODULE_ORDER), 0)))

    items.sort(key=rank)


@pytest.fixture(scope="session")
def sglang_launched(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                    ) -> Iterator[dict[str, Any]]:
    """The shared servers, started and not yet waited for (``sglang_servers`` waits); stopped at the end."""
    from sglang_server import launch_all, server_arms, stop_all

    work = tmp_path_factory.mktemp("sglang_server")
    modules = {test.module.__name__ for test in request.session.items  # the servers of the modules selected
               if SERVERS_FIXTURE in getattr(test, "fixturenames", ()) and getattr(test, "module", None)}
    arms = server_arms(work, modules)
    slots = ServerSlots(SGLANG_SLOTS * len(arms), "sglang shared servers")
    _SLOTS.append(slots)
    with stopping_servers() as held:
        slots.acquire()
        launched = launch_all(arms, work, nice=SHARED_NICE)
        held.update({name: live.server for name, live in launched.items()})
        _LIVE.update(launched)
        try:
            yield launched
        finally:
            stop_all(launched.values())
            _LIVE.clear()
            slots.release()


@pytest.fixture(scope="session")
def sglang_servers(sglang_launched: dict[str, Any]) -> dict[str, Any]:
    from sglang_server import await_all

    return await_all(sglang_launched, expect_failure=("bad",))


@pytest.fixture(autouse=True)
def _shared_servers_start_beside_checks(request: pytest.FixtureRequest) -> None:
    """Launch the shared SGLang servers at the first test of a module in ``START_BESIDE`` when a later test of
    the session uses them: those modules' check scripts compute on one core, and the servers' start-ups take the
    other, instead of running after them on both."""
    module = getattr(request.node, "module", None)
    if module is None or module.__name__.rsplit(".", 1)[-1] not in START_BESIDE:
        return
    items = request.session.items
    later = items[items.index(request.node):] if request.node in items else []
    if any(SERVERS_FIXTURE in getattr(test, "fixturenames", ()) for test in later):
        try:
            request.getfixturevalue("sglang_launched")
        except Exception as err:  # the tests that use the servers fail on it (pytest keeps the fixture's error)
            warnings.warn(f"the shared SGLang servers did not launch beside {request.node.nodeid}: {err}",
                          stacklevel=1)


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stop the shared SGLang servers once no later test of the session uses them (the engine tests that
    follow should not share the machine with them)."""
    if not _LIVE:
        return
    items = item.session.items
    later = items[items.index(item) + 1:] if item in items else []
    if not any(SERVERS_FIXTURE in getattr(test, "fixturenames", ()) for test in later):
        from sglang_server import stop_all

        stop_all(_LIVE.values())
        _LIVE.clear()
        for slots in _SLOTS:
            slots.release()


@pytest.fixture(scope="session")
def sglang_k0_3_served(sglang_servers: dict[str, Any]) -> dict[str, Any]:
    import sglang_server as sg

    from oea.launch.sglang_server import stop_server

    live = sglang_servers["k0_3"]
    answers = [a for _ in range(sg.K0_3_ROUNDS)
               for a in sg.generate(live.url, sg.PROMPTS, sg.K0_3_TOKENS, routed_experts=True)]
    pair = sg.generate(live.url, sg.PROMPTS[:2], sg.PAIR_TOKENS, routed_experts=True)
    one_by_one = sg.generate_one_by_one(live.url, sg.PROMPTS[:sg.ONE_BY_ONE], sg.ONE_BY_ONE_TOKENS)
    time.sleep(2.0)  # the metrics writer flushes every 0.5 s
    code = stop_server(live.server, grace=60.0)  # SIGTERM to the group; SIGKILL only after 60 s
    assert live.trace_path is not None
    return {"answers": answers, "pair": pair, "one_by_one": one_by_one,
            "metrics": sg.read_jsonl(Path(live.arm.env["OEA_METRICS_FILE"])), "trace_path": live.trace_path,
            "log": live.log(), "exit": code}
