"""Damage a checkpoint file in place, as a bad disk block does: the file keeps its size."""
from __future__ import annotations

import os
import struct
import zipfile


def nan_into_first_float(states: str) -> None:
    """Overwrite the first float32 of the largest tensor in ``torch.save`` archive ``states``
    with NaN (torch's zip archive stores each tensor's bytes as they are); the size is kept."""
    size = os.path.getsize(states)
    with zipfile.ZipFile(states) as z:
        entry = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(states, "r+b") as f:
        f.seek(entry.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", f.read(4))
        f.seek(entry.header_offset + 30 + name_len + extra_len)  # the entry's first float32
        f.write(struct.pack("<f", float("nan")))
    assert os.path.getsize(states) == size
