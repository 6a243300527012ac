"""Progress of a training run: tqdm bars, plain log lines, or nothing.

`progress="auto"` draws tqdm bars when the stream is a terminal and prints plain log lines
otherwise; "tqdm", "plain" or "none" force one. Under torchrun only rank 0 draws bars (the other
ranks' lines are plain, prefixed with their rank).
"""

from __future__ import annotations

import sys

from .distributed import dist_info, is_distributed

__all__ = ["Progress", "make_progress", "PROGRESS_MODES"]

PROGRESS_MODES = ("auto", "tqdm", "plain", "none")


class Progress:
    """A progress reporter: tqdm bars, plain log lines, or nothing.

    bar(total, desc) -> handle with update(n), set_postfix(**postfix), close(); log(msg)."""

    def __init__(self, mode: str = "auto", stream=None):
        if mode not in PROGRESS_MODES:
            raise ValueError(f"progress must be 'auto', 'tqdm', 'plain' or 'none', got {mode!r}")
        self.stream = stream or sys.stdout
        if mode == "auto":
            mode = "tqdm" if getattr(self.stream, "isatty", lambda: False)() else "plain"
        if dist_info().rank != 0 and mode == "tqdm":
            mode = "plain"  # bars from several ranks garble one terminal
        self.mode = mode

    def log(self, msg: str) -> None:
        if self.mode == "none":
            return
        if self.mode == "tqdm":
            from tqdm import tqdm

            tqdm.write(msg, file=self.stream)
        else:
            prefix = f"[rank {dist_info().rank}] " if is_distributed() else ""
            print(prefix + msg, file=self.stream, flush=True)

    def bar(self, total: int, desc: str, *, leave: bool = False, position: int | None = None):
        if self.mode == "tqdm":
            from tqdm import tqdm

            return tqdm(total=total, desc=desc, leave=leave, position=position, file=self.stream,
                        dynamic_ncols=True)
        return _NullBar()


class _NullBar:
    def update(self, n=1):
        pass

    def set_postfix(self, *a, **k):
        pass

    def close(self):
        pass


def make_progress(progress) -> Progress:
    """A Progress from a mode string, an existing Progress, None ("auto") or False ("none")."""
    if isinstance(progress, Progress):
        return progress
    if progress is None:
        return Progress("auto")
    if progress is False:
        return Progress("none")
    return Progress(progress)
