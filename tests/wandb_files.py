"""Read an offline W&B run file (``run-<id>.wandb``) without a network or a W&B server.

The file is a LevelDB-style log (7-byte file header, 32 KiB blocks, records split into FULL / FIRST /
MIDDLE / LAST chunks with a 7-byte chunk header) of ``wandb_internal_pb2.Record`` protobufs.
"""

from __future__ import annotations

import struct
from pathlib import Path

_BLOCK = 32768
_HEADER = 7


def _chunks(data: bytes):
    if data[:4] != b":W&B":
        raise ValueError("not a W&B run file")
    pos, pending = _HEADER, b""
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # block trailer padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        chunk = data[pos + _HEADER : pos + _HEADER + length]
        pos += _HEADER + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            yield pending + chunk
        elif kind == 0 and length == 0:
            pos += _BLOCK - pos % _BLOCK if pos % _BLOCK else 0


def read_run(path: str | Path) -> dict:
    """``{"name", "group", "tags", "config_keys", "history_keys"}`` of one offline run file."""
    from wandb.proto import wandb_internal_pb2 as pb

    out = {"name": None, "group": None, "tags": [], "config_keys": set(), "history_keys": set()}
    for raw in _chunks(Path(path).read_bytes()):
        rec = pb.Record()
        rec.ParseFromString(raw)
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            out["name"], out["group"], out["tags"] = rec.run.display_name, rec.run.run_group, list(rec.run.tags)
            out["config_keys"] |= {i.key for i in rec.run.config.update}
        elif kind == "config":
            out["config_keys"] |= {i.key for i in rec.config.update}
        elif kind == "history":
            out["history_keys"] |= {i.key or "/".join(i.nested_key) for i in rec.history.item}
    return out
