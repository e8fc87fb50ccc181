"""Preemption: SIGTERM/SIGINT stop the training loop after the current step (a checkpoint is then
saved); a second signal exits at once. With several processes they agree on the stopping step."""
from __future__ import annotations

import os
import signal
import sys
import threading

import jax
import numpy as np


class Preemption:
    """SIGTERM/SIGINT: the first stops the loop after the current step; a second exits now."""

    def __init__(self):
        self.signum: int | None = None
        self._old = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGTERM, signal.SIGINT):
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)
        return False

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.signum is not None:
            print(f"\njaxscale train: second signal ({name}): exiting now; finalized "
                  f"checkpoints are untouched, an unfinished save is discarded on resume",
                  file=sys.stderr, flush=True)
            os._exit(128 + signum)
        self.signum = signum
        print(f"\njaxscale train: {name} received: finishing this step, then saving a checkpoint "
              f"(send it again to exit at once)", file=sys.stderr, flush=True)

    @property
    def name(self) -> str | None:
        return signal.Signals(self.signum).name if self.signum is not None else None

    def agreed(self) -> bool:
        """Whether any process was signalled: all processes take the same decision each step."""
        flag = self.signum is not None
        if jax.process_count() == 1:
            return flag
        from jax.experimental import multihost_utils
        return bool(np.any(multihost_utils.process_allgather(np.array([int(flag)], np.int32))))
