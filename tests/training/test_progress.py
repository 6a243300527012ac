"""The progress reporter (fastweights.training.progress): plain lines off a terminal, nothing for
"none", a clear error for an unknown mode."""

import io

import pytest

from fastweights.training.progress import Progress, make_progress


def test_modes():
    buf = io.StringIO()  # not a TTY: "auto" means plain lines
    prog = Progress("auto", stream=buf)
    assert prog.mode == "plain"
    prog.log("hello")
    bar = prog.bar(3, "x")
    bar.update(1)
    bar.close()
    assert buf.getvalue() == "hello\n"
    assert make_progress(False).mode == "none" and make_progress(prog) is prog
    assert make_progress("plain").mode == "plain"
    with pytest.raises(ValueError, match="progress must be 'auto', 'tqdm', 'plain' or 'none', got 'loud'"):
        Progress("loud")
