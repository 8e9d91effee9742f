"""The e2e tests' `wait_for`: a poll that fails is asked again until the deadline, and a last poll that failed says
why (`support.e2e_support`)."""

from __future__ import annotations

import pytest

from support.e2e_support import wait_for


def test_a_poll_that_times_out_is_asked_again():
    answers = iter([TimeoutError("slow /metrics"), TimeoutError("slow /metrics"), True])

    def poll() -> bool:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert wait_for(poll, 5, interval=0.01)


def test_a_condition_that_never_holds_fails_at_its_deadline():
    assert not wait_for(lambda: False, 0.05, interval=0.01)


def test_a_server_that_never_answers_raises_its_error_at_the_deadline():
    def poll() -> bool:
        raise ConnectionRefusedError("gone")

    with pytest.raises(ConnectionRefusedError):
        wait_for(poll, 0.05, interval=0.01)


def test_negative_control_other_errors_are_not_polled_past():
    def poll() -> bool:
        raise ValueError("a bug in the check")

    with pytest.raises(ValueError):
        wait_for(poll, 5, interval=0.01)
