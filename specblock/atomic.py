"""Every file the project writes goes through here: checked before the work, written atomically.

Why: a run that fails (a bad flag, a model that does not load, Ctrl-C, a full disk) must leave
what an earlier run wrote exactly as it was, and a long bench must not learn only at the end that
it cannot write its results (issue 15). So output paths are checked first (:func:`check_output`),
and the data goes to a temporary file in the same directory that replaces the target in one
``os.replace`` only when it is complete (:func:`atomic_open`, :func:`write_atomic`). Torch-free:
the simulator uses it too.
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
from pathlib import Path
from typing import IO, Iterator

from specblock.errors import SpecBlockError


def check_output(path: str | Path, flag: str, make_parents: bool = False) -> Path:
    """Refuse, before any work, an output path that cannot be written: a directory, a missing or
    read-only parent. ``make_parents`` creates missing parents (bench results, sweep caches)."""
    path = Path(path)
    if path.is_dir():
        raise SpecBlockError(f"{flag} {path} is a directory; give a file name")
    parent = path.parent
    if make_parents:
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise SpecBlockError(f"{flag}: cannot create the directory {parent} ({e.strerror}); choose another place") from None
    if not parent.is_dir():
        why = "is not a directory" if parent.exists() else "does not exist"
        raise SpecBlockError(f"{flag} {path}: {parent} {why}; create it or choose another place")
    try:  # os.access says yes to root on a read-only mount: try it for real
        with _sigint_deferred():  # Ctrl-C between create and unlink would leave the probe behind
            fd, probe = tempfile.mkstemp(dir=parent, prefix=f".{path.name}.", suffix=".probe")
            os.close(fd)
            os.unlink(probe)
    except OSError as e:
        raise SpecBlockError(f"{flag} {path}: cannot write in {parent} ({e.strerror}); choose another place") from None
    if path.exists() and not os.access(path, os.W_OK):
        raise SpecBlockError(f"{flag} {path} is read-only; choose another place")
    return path


@contextlib.contextmanager
def _sigint_deferred() -> Iterator[None]:
    """Hold Ctrl-C for a few statements; it is raised when the block ends.

    Why: Python raises KeyboardInterrupt between any two bytecodes, so a Ctrl-C landing after
    ``mkstemp`` created its file but before the name reached a handler that removes it left a
    ``.name.XXXX.tmp`` behind (seen in CI: a sweep interrupted while writing a cache entry). A
    signal mask would not do: the kernel hands a process-wide SIGINT to any thread that does not
    block it (a process pool's manager thread, say), so the Python handler is swapped instead."""
    held: list = []
    if signal.getsignal(signal.SIGINT) is None:  # a handler set outside Python: it cannot be put back
        yield
        return
    try:
        old = signal.signal(signal.SIGINT, lambda signum, frame: held.append(frame))
    except ValueError:  # not the main thread, where KeyboardInterrupt is never raised anyway
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
        if held:
            if callable(old):
                old(signal.SIGINT, held[0])  # Python's default handler raises KeyboardInterrupt here
            elif old == signal.SIG_DFL:
                os.kill(os.getpid(), signal.SIGINT)


@contextlib.contextmanager
def atomic_open(path: str | Path, mode: str = "w", **kw) -> Iterator[IO]:
    """Write to a temporary file beside ``path``; it replaces ``path`` only when the block ends
    normally. On any exception (Ctrl-C included) ``path`` keeps its old content and no temporary
    file stays behind."""
    path = Path(path)
    tmp: str | None = None
    fd = -1
    try:
        with _sigint_deferred():  # a Ctrl-C held here is raised inside this try, with tmp known
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        f = os.fdopen(fd, mode, **kw)
        fd = -1  # the file object owns it now
        with f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        with _sigint_deferred():  # replaced and forgotten together, or neither
            if path.exists():
                os.chmod(tmp, path.stat().st_mode & 0o777)  # keep the old file's permissions
            else:
                os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp's 0600 would surprise next to ordinary files
            os.replace(tmp, path)
            tmp = None
    except BaseException:
        if fd >= 0:
            os.close(fd)
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        raise


def write_atomic(path: str | Path, data: str | bytes) -> None:
    with atomic_open(path, "wb" if isinstance(data, bytes) else "w", **({} if isinstance(data, bytes) else {"encoding": "utf-8"})) as f:
        f.write(data)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _umask()  # read once at import: os.umask is process-wide, so no thread may see it at 0 later


class AtomicFiles(contextlib.ExitStack):
    """Files under ``root`` opened on first use and kept open; all of them replace their old
    versions together when the ``with`` block ends normally, none when it raises. ``root``
    None: :meth:`get` gives None (nothing asked to be written)."""

    def __init__(self, root: str | Path | None) -> None:
        super().__init__()
        self.root = None if root is None else Path(root)
        self.files: dict[str, IO] = {}

    def get(self, name: str, mode: str = "w", **kw) -> IO | None:
        if self.root is None:
            return None
        if name not in self.files:
            kw = kw if "b" in mode else {"encoding": "utf-8", **kw}
            self.files[name] = self.enter_context(atomic_open(self.root / name, mode, **kw))
        return self.files[name]
