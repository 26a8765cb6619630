"""The soak's health verdict: a slow answer on a CPU-starved machine is not an unhealthy one, a hung or failing
server is."""

from __future__ import annotations

from oea.soak.checks import arm_checks
from oea.soak.monitor import MAX_SILENCE_S, NO_ANSWER, UNREACHABLE, Health


def _report(samples: list[tuple[float, int, float]]) -> dict:
    return {"failed": 0, "failures": [], "warmup": {"failed": 0, "failures": [], "sent": 0}, "sent": 10,
            "aborted": 5, "restarts": 0, "health": Health(samples).summary()}


def _healthy(samples: list[tuple[float, int, float]]) -> bool:
    return arm_checks("arm", _report(samples))[1].held


def test_a_health_request_that_timed_out_once_is_counted_apart_not_as_unhealthy() -> None:
    samples = [(0.0, 200, 3.0), (1.0, NO_ANSWER, 10_000.0), (12.0, 200, 900.0)]
    summary = Health(samples).summary()
    assert (summary["unhealthy"], summary["no_answer"]) == (0, 1)
    assert summary["longest_silence_s"] == 11.9  # from the unanswered request to the next answer's end
    assert _healthy(samples)


def test_a_server_silent_for_longer_than_the_bound_is_not_healthy() -> None:
    step = 11.0
    silent = [(1.0 + i * step, NO_ANSWER, 10_000.0) for i in range(int(MAX_SILENCE_S / step) + 2)]
    samples = [(0.0, 200, 3.0), *silent]
    assert Health(samples).longest_silence_s() > MAX_SILENCE_S
    assert not _healthy(samples)
    assert not _healthy([*samples, (samples[-1][0] + step, 200, 5.0)])  # an answer after the silence does not undo it


def test_an_error_answer_or_a_refused_connection_is_unhealthy() -> None:
    for status in (503, UNREACHABLE):
        samples = [(0.0, 200, 3.0), (1.0, status, 2.0), (2.0, 200, 3.0)]
        summary = Health(samples).summary()
        assert (summary["unhealthy"], summary["first_unhealthy_status"]) == (1, status)
        check = arm_checks("arm", _report(samples))[1]
        assert not check.held and f"status {status}" in check.detail
