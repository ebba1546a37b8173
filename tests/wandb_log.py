"""Read an offline W&B run file (``run-ID.wandb``) back with wandb's own record schema.

Why this exists: wandb 0.2x dropped its Python reader of the run file
(``wandb.sdk.internal.datastore``; the Go service writes the file now). The file is a
LevelDB-style log, a 7-byte ``:W&B`` header then 32 KiB blocks of framed chunks
(crc32 4 bytes, length 2, type 1: full / first / middle / last), each whole record one
``wandb_internal_pb2.Record`` protobuf. The framing is ten lines; the records are parsed by
wandb's own protobuf classes, so what the test reads is what ``wandb sync`` would upload.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Iterator

BLOCK = 32 * 1024
HEADER = 7  # ":W&B" + magic 0xBEE1 + version


def records(path: Path) -> Iterator[Any]:
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path}: not a W&B run file"
    pos, pending = HEADER, b""
    while pos + 7 <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < 7:  # the block's tail is padding
            pos += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7: pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(pending)
            yield rec
            pending = b""


def history(path: Path) -> list[dict[str, Any]]:
    """Every ``run.log`` row of the file, as {key: value}."""
    rows = []
    for rec in records(path):
        if rec.WhichOneof("record_type") == "history":
            rows.append({(it.key or "/".join(it.nested_key)): json.loads(it.value_json) for it in rec.history.item})
    return rows
