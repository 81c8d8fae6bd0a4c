"""The one writer for every file pedestrian writes: atomic, and one clear error when the OS refuses.

Files (:func:`write_file`): the content goes to a temporary file in the same folder
(``.NAME.tmp-XXXX``), is flushed to disk (``fsync``), then ``os.replace``-d onto ``NAME`` (one
atomic rename) and the folder is fsync-ed, so ``NAME`` holds either the old or the new content,
never a mix, whatever happens.

Folders (:func:`atomic_dir`): the files are written into a hidden sibling ``.NAME.tmp-XXXX`` and
fsync-ed; then ``NAME`` is renamed to ``.NAME.old``, the new folder renamed to ``NAME``, and
``.NAME.old`` deleted. A kill at any moment leaves a complete folder at ``NAME`` or -- only
between the two renames -- at ``.NAME.old`` (see :func:`interrupted_copy`), which the next write
puts back (:func:`recover`); an error (an ``Exception``) between the two renames puts it back at
once. With ``merge=True`` an existing folder is kept and each new file replaces its namesake by
one ``os.replace`` (its other files stay).

Logs (:class:`AppendLog`): one ``os.write`` per record, so a record is either written or
reported.

Failures: an ``OSError`` while writing -- no space left (ENOSPC), disk quota (EDQUOT), file too
large (EFBIG), no permission (EACCES, EPERM), read-only file system (EROFS), any other -- and
the ``SafetensorError`` that the ``safetensors`` writer raises for one, and the plain
``Exception("... (os error N)")`` of the ``tokenizers`` writer (neither is an ``OSError``), become
one :class:`WriteError`. Its message is one line: what could not be written
and where, why, what was kept (the previous file or folder is left as it was; nothing
half-written remains) and how to go on. ``pedestrian``'s command line prints it as its
``error:`` line (exit status 2).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Union

__all__ = ["WriteError", "write_file", "atomic_dir", "AppendLog", "make_dirs", "reporting",
           "write_all", "recover", "interrupted_copy"]

Content = Union[bytes, str, Iterable[bytes], Callable[[Path], None]]

#: errno -> (why, what to do about it)
_ADVICE = {
    errno.ENOSPC: ("no space left on the device (ENOSPC)",
                   "Free some disk space (or choose a folder on another disk)"),
    getattr(errno, "EDQUOT", -1): ("the disk quota is exceeded (EDQUOT)",
                   "Free some space within your quota (or choose another folder)"),
    errno.EFBIG: ("the file is too large for this file system (EFBIG)",
                  "Choose a folder on a file system that allows larger files (FAT32 stops at 4 GiB)"),
    errno.EACCES: ("permission denied (EACCES)",
                   "Choose a folder you may write to, or fix the permissions of this one"),
    errno.EPERM: ("operation not permitted (EPERM)",
                  "Choose a folder you may write to, or fix the permissions of this one"),
    errno.EROFS: ("the file system is read-only (EROFS)", "Choose a folder on a writable file system"),
}
# safetensors' Rust writer reports an io::Error as "... (os error 28) ..."
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")


class WriteError(OSError):
    """A file or folder could not be written; whatever was there before is left as it was.

    ``str(error)`` is one line: ``could not write WHAT PATH: WHY; KEPT. ACTION, then THEN.``

    Attributes:
        path: the file or folder that was being written (``Path``).
        what: what it is, e.g. ``"the checkpoint"``.
        errno / strerror: of the underlying ``OSError`` (``errno`` may be ``None``).
        kept: what survived, one phrase per item (the writer's own first, callers may add).
        then: how to go on once the cause is fixed (default: run the command again).
    """

    def __init__(self, path, what: str, cause: OSError, kept: list[str], then: str | None = None):
        super().__init__(cause.errno, cause.strerror or str(cause))
        self.path = Path(path)
        self.filename = str(path)
        self.what = what
        self.cause = cause
        self.kept = list(kept)
        self.then = then or "run the command again"

    def advise(self, kept: str | None = None, then: str | None = None) -> "WriteError":
        """A copy with one more ``kept`` phrase and/or another ``then`` (how to go on). A
        phrase that names :attr:`path` itself replaces the generic one about it."""
        old = self.kept
        if kept and str(self.path) in kept:
            old = [k for k in old if k not in _GENERIC_KEPT]
        return WriteError(self.path, self.what, self.cause, old + ([kept] if kept else []),
                          then or self.then)

    def __str__(self) -> str:
        why, action = _ADVICE.get(self.cause.errno, (None, "Check the folder and its disk"))
        if why is None:
            why = self.cause.strerror or str(self.cause) or type(self.cause).__name__
        return (f"could not write {self.what} {self.path}: {why}; {'; '.join(self.kept)}. "
                f"{action}, then {self.then}")

    def __reduce__(self):  # OSError pickles its args only; keep every field
        return (WriteError, (self.path, self.what, self.cause, self.kept, self.then))


def _os_error_of(exc: BaseException) -> OSError | None:
    """The ``OSError`` behind ``exc`` (itself, or the one a ``SafetensorError`` or a ``tokenizers``
    error wraps), else None."""
    if isinstance(exc, OSError):
        return exc
    if type(exc) is Exception:
        # the tokenizers library (tokenizer.json, vocab.json, merges.txt) raises a plain
        # Exception("No space left on device (os error 28)") for an io::Error
        m = _RUST_OS_ERROR.search(str(exc))
        return OSError(int(m.group(1)), os.strerror(int(m.group(1)))) if m else None
    if type(exc).__name__ == "SafetensorError":
        text = str(exc)
        m = _RUST_OS_ERROR.search(text)
        if m:
            code = int(m.group(1))
            return OSError(code, os.strerror(code))
        if "I/O error" in text or "IoError" in text:
            return OSError(None, text.splitlines()[0])
    return None


_GENERIC_KEPT = ("the previous one there is unchanged", "nothing was left there")


def _kept_phrase(existed: bool) -> str:
    return _GENERIC_KEPT[0] if existed else _GENERIC_KEPT[1]


@contextlib.contextmanager
def reporting(path, what: str, then: str | None = None, kept: str | None = None) -> Iterator[None]:
    """Turn an ``OSError`` (or safetensors' / tokenizers' I/O errors) raised inside the block
    into a :class:`WriteError` about ``path``; other exceptions pass through unchanged. A
    :class:`WriteError` about another path (a file written inside the folder being written) is
    reported as one about ``path``.

    Args:
        path: the file or folder being written. what: how to name it (``"the token cache"``).
        then: how to go on (default: run the command again).
        kept: what survives (default: whether ``path`` existed before the block).
    """
    path = Path(path).expanduser()
    if kept is None:
        kept = _kept_phrase(os.path.lexists(path))
    try:
        yield
    except WriteError as exc:
        if exc.path == path:
            raise
        # a writer nested inside this one (a file of a folder being written): report ours
        raise WriteError(path, what, exc.cause, [kept], then) from exc
    except BaseException as exc:
        cause = _os_error_of(exc)
        if cause is None:
            raise
        raise WriteError(path, what, cause, [kept], then) from exc


def write_all(fd: int, data) -> None:
    """Write all of ``data`` (bytes-like) to file descriptor ``fd`` (``os.write`` until done).

    Raises:
        OSError: from ``os.write`` (e.g. ENOSPC once the disk is full).
    """
    view = memoryview(data).cast("B")
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable; a no-op where folders cannot be opened (Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - e.g. Windows cannot open folders
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some file systems refuse fsync on a folder
        pass
    finally:
        os.close(fd)


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def make_dirs(path, what: str = "the folder", then: str | None = None) -> Path:
    """``mkdir -p path`` with a :class:`WriteError` (not a traceback) if the OS refuses."""
    path = Path(path).expanduser()
    with reporting(path, what, then):
        path.mkdir(parents=True, exist_ok=True)
    return path


def write_file(path, content: Content, *, what: str = "the file", then: str | None = None) -> Path:
    """Write a file atomically (see the module docstring); the parent folder is created.

    Args:
        path: the file to create or replace.
        content: ``bytes``; ``str`` (written as UTF-8); an iterable of ``bytes`` chunks
            (streamed); or a function that writes the file at the ``Path`` it is given (for
            libraries that only write to a path, e.g. safetensors).
        what: how to name the file in an error (``"the loss curve"``).
        then: how to go on after a failure (default: run the command again).

    Returns:
        ``path``. The file gets the permissions of a plain ``open`` (``0o666 & ~umask``).

    Raises:
        WriteError (an ``OSError``): the OS refused (no space, too large, no permission,
            read-only, ...); ``path`` is left as it was and no temporary file remains.
    """
    final = Path(path).expanduser()
    with reporting(final, what, then):
        final.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=final.parent, prefix=f".{final.name}.tmp-")
        tmp = Path(name)
        try:
            try:
                if callable(content):
                    os.close(fd)
                    fd = -1
                    content(tmp)
                else:
                    chunks = [content] if isinstance(content, (bytes, bytearray, memoryview, str)) \
                        else content
                    for chunk in chunks:
                        write_all(fd, chunk.encode("utf-8") if isinstance(chunk, str) else chunk)
                    os.fsync(fd)
            finally:
                if fd >= 0:
                    os.close(fd)
            if callable(content):
                _fsync_path(tmp)
            os.chmod(tmp, 0o666 & ~_umask())       # mkstemp makes it 0600
            os.replace(tmp, final)
        except BaseException:
            _unlink_quietly(tmp)
            raise
        _fsync_dir(final.parent)
    return final


# ------------------------------------------------------------------------------------ folders
def interrupted_copy(final) -> Path:
    """Where :func:`atomic_dir` keeps the old folder between its two renames:
    ``PARENT/.NAME.old``. After a kill at that moment the complete old folder is found here."""
    final = Path(final)
    return final.parent / f".{final.name}.old"


def recover(final) -> None:
    """Finish or clean up after a folder write that was killed (see the module docstring): put
    ``.NAME.old`` back if ``NAME`` is missing, delete it if ``NAME`` is there, and delete
    incomplete ``.NAME.tmp-*`` folders."""
    final = Path(final)
    old = interrupted_copy(final)
    if old.exists():
        if final.exists():
            shutil.rmtree(old)                  # killed after the swap: old is stale
        else:
            os.rename(old, final)               # killed between the renames: put it back
    for stale in final.parent.glob(f".{final.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)   # killed while writing: incomplete


def _swap_into_place(tmp: Path, final: Path) -> None:
    old = interrupted_copy(final)
    if final.exists():
        os.rename(final, old)
    try:
        os.rename(tmp, final)
    except Exception:
        if old.exists() and not final.exists():
            os.rename(old, final)               # an error (not a kill): put the old one back now
        raise
    _fsync_dir(final.parent)
    if old.exists():
        shutil.rmtree(old, ignore_errors=True)  # if this fails, the next write removes it


def _merge_into_place(tmp: Path, final: Path) -> None:
    for f in sorted(tmp.iterdir()):
        os.replace(f, final / f.name)
    _fsync_dir(final)
    tmp.rmdir()


@contextlib.contextmanager
def atomic_dir(directory, *, what: str = "the folder", then: str | None = None,
               merge: bool = False) -> Iterator[Path]:
    """Write a folder atomically: fill the temporary folder this yields; when the block ends
    without an error it replaces ``directory`` (module docstring), otherwise it is removed and
    ``directory`` is left as it was.

    Args:
        directory: the folder to create or replace; its parent is created if needed.
        what / then: for the :class:`WriteError` (see :func:`write_file`).
        merge: keep an existing folder and its other files; each new file replaces its
            namesake by one ``os.replace`` (an export into a folder that holds other files).

    Yields:
        the temporary folder (``Path``) to write the files into (flat; every file in it is
        fsync-ed and given ``0o666 & ~umask`` permissions before the swap).

    Raises:
        WriteError: the OS refused (the previous folder is intact). Exceptions of the block
            that are not OS errors pass through unchanged (the temporary folder is removed).
    """
    final = Path(directory).expanduser()
    with reporting(final, what, then):
        final.parent.mkdir(parents=True, exist_ok=True)
        recover(final)
        tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.tmp-"))
        try:
            os.chmod(tmp, 0o777 & ~_umask())        # mkdtemp makes it private (0700)
            yield tmp
            mode = 0o666 & ~_umask()
            for f in tmp.iterdir():
                if f.is_file():
                    os.chmod(f, mode)               # safetensors and mkstemp make theirs 0600
                    _fsync_path(f)
            _fsync_dir(tmp)
            if merge and final.is_dir():
                _merge_into_place(tmp, final)
            else:
                _swap_into_place(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


# ------------------------------------------------------------------------------------ logs
class AppendLog:
    """A text log written record by record: each :meth:`write` is one ``os.write`` of its UTF-8
    bytes (no buffer), so an OS error surfaces at the record that hit it, as a
    :class:`WriteError` naming the log; the records before it stay in the file.

    Args:
        path: the log file (created if missing; its folder must exist).
        what: how to name it in an error (``"the training log"``).
        truncate: start the file empty (else append to it).

    Raises:
        WriteError: the file cannot be opened, or a record cannot be written.
    """

    def __init__(self, path, what: str = "the log", *, truncate: bool = False):
        self.path = Path(path).expanduser()
        self.what = what
        flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if truncate else os.O_APPEND)
        with reporting(self.path, what):
            self._fd = os.open(self.path, flags, 0o666)

    def write(self, text: str) -> int:
        """Append ``text`` (a whole record, newline included); returns its length."""
        with reporting(self.path, what=self.what, kept="its earlier records are kept"):
            write_all(self._fd, text.encode("utf-8"))
        return len(text)

    def flush(self) -> None:
        """Nothing to do: every record is handed to the OS as it is written."""

    def close(self) -> None:
        """Close the file (a second call does nothing)."""
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)

    def __enter__(self) -> "AppendLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
