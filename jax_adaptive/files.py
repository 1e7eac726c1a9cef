"""Files we write are ours: whole-file replacements that a crash never leaves half written.

`write_atomic` is the one way a file is rewritten (the command line's ``plan.json``, the
kept lines of ``metrics.jsonl``, ...): a temporary file created exclusively under a name
no one can predict, never through a symbolic link, its bytes ``fsync``-ed before
``os.replace`` puts it in place, and the directory ``fsync``-ed after. Importing it does
not start JAX.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

__all__ = ["write_atomic"]


def write_atomic(path: str | os.PathLike[str], text: str | bytes) -> None:
    """Replaces ``path``'s contents with ``text`` at once: readers see the old or the new file.

    New files get ``0o666`` less the umask (as ``open`` gives); a crash at any moment
    leaves the old file whole or the new one, and at most a stray ``.<name>.<hex>.tmp``
    beside it.

    Raises:
        OSError: the file cannot be written (a symbolic link where the temporary file
            goes, a full disk, ...); ``path`` is then unchanged.

    Examples:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "plan.json"
        >>> write_atomic(path, '{"a": 1}')
        >>> write_atomic(path, '{"a": 2}')
        >>> path.read_text(), [p.name for p in path.parent.iterdir()]
        ('{"a": 2}', ['plan.json'])
    """
    path = Path(path)
    data = text.encode() if isinstance(text, str) else text
    # O_EXCL under an unguessable name, as tempfile.mkstemp, but the umask sets the mode.
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(tmp, flags, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    # The rename itself is durable once the directory is; some filesystems refuse this.
    with contextlib.suppress(OSError):
        directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
