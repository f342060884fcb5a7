"""Read an offline W&B run back: the history rows and config in its ``run-<id>.wandb`` file.

wandb (0.2x–0.31) has no public reader of that file, and its Python one
(``wandb.sdk.internal.datastore``) is gone; the file is LevelDB's log format (32 KiB blocks of
records with a 7-byte header: CRC32C, length, type FULL/FIRST/MIDDLE/LAST) after a 7-byte file
header (``:W&B``, 0xBEE1, version 0), each record a ``wandb.proto.wandb_internal_pb2.Record``
(the same layout the removed datastore read)."""
from __future__ import annotations

import json
import struct
from pathlib import Path

_BLOCK = 32 * 1024
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def records(path: str | Path) -> list:
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path}: not a W&B run file"
    out, pos, pending = [], 7, b""
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:  # a block's tail too short for a header is zero padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # preallocated, never written
            break
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == _FULL:
            payload = chunk
        elif kind == _FIRST:
            pending = chunk
            continue
        elif kind == _MIDDLE:
            pending += chunk
            continue
        else:
            payload, pending = pending + chunk, b""
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(payload)
        out.append(rec)
    return out


def history(path: str | Path) -> list[dict]:
    """Each history row as {key: value}, with ``_step``."""
    rows = []
    for rec in records(path):
        if rec.WhichOneof("record_type") == "history":
            rows.append({(item.key or "/".join(item.nested_key)): json.loads(item.value_json)
                         for item in rec.history.item})
    return rows


def config(path: str | Path) -> dict:
    """The run's config as last written ({key: value})."""
    out = {}
    for rec in records(path):
        if rec.WhichOneof("record_type") == "config":
            for item in rec.config.update:
                value = json.loads(item.value_json)
                out[item.key or "/".join(item.nested_key)] = value
        elif rec.WhichOneof("record_type") == "run":
            for item in rec.run.config.update:
                out[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return out


def run_id(path: str | Path) -> str:
    for rec in records(path):
        if rec.WhichOneof("record_type") == "run":
            return rec.run.run_id
    raise AssertionError(f"{path}: no run record")
