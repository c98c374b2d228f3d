"""Files written whole or not at all: a temporary file beside the target,
renamed over it once complete (and verified, where the caller verifies)."""

import contextlib
import os
import tempfile


def new_file_mode():
    """The mode ``open(path, "w")`` gives a new file under the current
    umask (``tempfile.mkstemp`` makes its files 0600, and a rename keeps
    that)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


@contextlib.contextmanager
def temporary_beside(path, suffix, prefix="tmp"):
    """The path of a new empty temporary file in ``path``'s folder (so that
    the rename is atomic), removed on the way out if it is still there.
    Where none can be made there, the ``OSError`` names ``path``."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(suffix=suffix, dir=folder, prefix=prefix)
    except OSError as e:  # named by the file asked for, not the temporary
        if e.errno is None:
            raise
        raise type(e)(e.errno, f"{e.strerror}: cannot write {path} (no "
                      f"new file can be made in its folder {folder})") from e
    os.close(fd)
    try:
        yield tmp
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def publish(tmp, path):
    """Give ``tmp`` a new file's mode and rename it to ``path``."""
    os.chmod(tmp, new_file_mode())
    os.replace(tmp, path)
