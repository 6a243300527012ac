"""Stop requests (fastweights.training.control), with real SIGINTs to this process: the first one
during a training loop only requests a stop; a second one, or one outside a loop, interrupts."""

import os
import signal
import sys

import pytest

from fastweights.training.control import (
    clear_stop,
    request_stop,
    stop_on_sigint,
    stop_on_signals,
    stop_requested,
    training,
)

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")


def _sigint():
    os.kill(os.getpid(), signal.SIGINT)  # delivered to the main thread before os.kill returns to Python code


def test_first_sigint_in_a_training_loop_requests_a_stop_and_a_second_interrupts():
    before = signal.getsignal(signal.SIGINT)
    with stop_on_sigint():
        with training():
            _sigint()
            assert stop_requested()
            with pytest.raises(KeyboardInterrupt):
                _sigint()
        assert stop_requested()
    assert not stop_requested() and signal.getsignal(signal.SIGINT) is before  # cleared and restored


def test_sigint_outside_a_training_loop_interrupts_at_once():
    with stop_on_sigint():
        with pytest.raises(KeyboardInterrupt):
            _sigint()
        assert not stop_requested()


def test_request_and_clear():
    clear_stop()
    request_stop()
    assert stop_requested()
    clear_stop()
    assert not stop_requested()


def test_sigterm_too_and_repeats_ignored_under_torchrun():
    with stop_on_signals((signal.SIGINT, signal.SIGTERM), repeats="ignore"):
        with training():
            os.kill(os.getpid(), signal.SIGTERM)
            assert stop_requested()
            _sigint()  # (the terminal's Ctrl-C and torchrun's forward of it: the save goes on)
            os.kill(os.getpid(), signal.SIGTERM)
            assert stop_requested()
        with pytest.raises(KeyboardInterrupt):  # outside a training loop it interrupts
            os.kill(os.getpid(), signal.SIGTERM)
    with pytest.raises(ValueError, match="repeats must be 'interrupt' or 'ignore'"):
        with stop_on_signals(repeats="sometimes"):
            pass
