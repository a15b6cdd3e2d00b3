"""One line on stderr when a compile makes the user wait.

Why: the first use of a tree size compiles the target's step for about a minute on a 2-core CPU
(SpecBlock's block: about 20 s), in the middle of a first prompt that otherwise takes a second.
Loading a saved graph takes well under a second, and then nothing is printed: the line appears
only once the call has run for ``after`` seconds, and says how long it took when it ends.
"""

from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def notice_if_slow(what: str, after: float = 3.0) -> Iterator[None]:
    start = time.perf_counter()
    shown = threading.Event()

    def show() -> None:
        shown.set()
        print(f"specblock: {what} (first use; saved for later starts) ...", file=sys.stderr, flush=True)

    timer = threading.Timer(after, show)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        if shown.is_set():
            print(f"specblock: {what}: done in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
