"""Read back an offline wandb run (WANDB_MODE=offline) for tests: the records of its `run-<id>.wandb` file.

The file is wandb's LevelDB-style log (what `wandb sync` uploads): a 7-byte header (":W&B", magic, version), then
32 KiB blocks of chunks, each with a 7-byte header (crc32, length, type FULL=1 / FIRST=2 / MIDDLE=3 / LAST=4); a
block tail shorter than a chunk header is padding. Every record is a `wandb.proto.wandb_internal_pb2.Record`.
"""
from __future__ import annotations

import glob
import json
import os
import struct
import time

BLOCK, HEADER = 32768, 7


def offline_run_dir(wandb_dir: str) -> str:
    runs = glob.glob(os.path.join(wandb_dir, "wandb", "offline-run-*"))
    assert len(runs) == 1, f"expected one offline run under {wandb_dir}/wandb, found {runs}"
    return runs[0]


def read_records(run_dir: str, timeout: float = 60.0) -> list:
    """Every record of the run, once its `exit` record is on disk. `run.finish()` can return before wandb's writer
    (the wandb-core service, another process) has flushed the file: on a loaded box the suite once read a file that
    held only its header. So wait, up to `timeout` seconds, for the last record a finished run writes."""
    deadline = time.monotonic() + timeout
    while True:
        records = _parse(run_dir)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def _parse(run_dir: str) -> list:
    from wandb.proto import wandb_internal_pb2

    (path,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", f"{path} is not a wandb log"
    pos, chunks, pending = HEADER, [], b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if pos + HEADER + length > len(data):
            break  # a chunk still being written
        payload = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind == 1:
            chunks.append(payload)
        elif kind == 2:
            pending = payload
        elif kind == 3:
            pending += payload
        elif kind == 4:
            chunks.append(pending + payload)
        else:
            break  # zero padding at the end of the last block
    records = []
    for chunk in chunks:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(chunk)
        records.append(record)
    return records


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def history(records: list) -> dict[int, dict]:
    """{step: {key: value}} of the run's logged history (values JSON-decoded)."""
    out: dict[int, dict] = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            out.setdefault(r.history.step.num, {}).update({_key(i): json.loads(i.value_json) for i in r.history.item})
    return out


def run_info(records: list) -> tuple[str, str, dict]:
    """(project, display name, config) from the run record."""
    for r in records:
        if r.WhichOneof("record_type") == "run":
            config = {_key(i): json.loads(i.value_json) for i in r.run.config.update}
            return r.run.project, r.run.display_name, config
    raise AssertionError("no run record in the wandb log")
