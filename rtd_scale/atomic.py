"""Write a file so that readers see the old content or the new, never half of it: write a
temporary name in the same directory, then ``os.replace`` (atomic on POSIX). The one helper the
project uses for config, metadata, tokenizer and corpus files."""
from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: str | os.PathLike, data: bytes | str) -> None:
    """Write ``data`` (text is UTF-8) to ``path`` atomically; creates the parent directory.

    Raises:
        OSError: the directory cannot be created or written (the temporary file is removed).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
