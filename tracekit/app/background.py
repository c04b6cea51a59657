"""Work that runs on a thread beside a block of the command (the live view of `record --watch`, the
hang check): the thread starts as the block is entered, is told to stop when it ends, and is waited for.

    with in_background(lambda stop: poll_until(stop), "tracekit-poll"):
        run_the_command()
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator


@contextlib.contextmanager
def in_background(work: Callable[[threading.Event], None], name: str) -> Iterator[None]:
    """`work(stop)` on a daemon thread named `name` while the block runs; `stop` is set when the block
    ends (however it ends), and the thread is joined before the block's exit goes on."""
    stop = threading.Event()
    thread = threading.Thread(target=work, args=(stop,), name=name, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
