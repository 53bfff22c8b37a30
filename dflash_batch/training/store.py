"""A compact, append-only store of generated token ids, sharded, resumable and crash-safe.

A store is a folder::

    store.json            {"version", "dtype"}: token ids as uint16 (vocab <= 65536) or uint32
    shard-00000.bin ...   one shard per writer session (a run on one machine), never rewritten

A shard is a sequence of records, each a 32-byte header and its tokens::

    magic b"DFA1" | key u64 | sample u32 | count u32 | flags u32 | temp_milli u32 | crc32 u32
    count token ids (dtype of store.json)

``key`` names the prompt (a hash of its token ids, ``prompt_key``), ``sample`` the answer of
that prompt (0: greedy, k >= 1: the k-th sampled answer), ``flags`` bit 0: the answer ended on
EOS. The CRC covers the header (its CRC field zeroed) and the tokens, so a record cut by a
crash, or damaged, is detected: a writer truncates its shard's torn tail before appending,
readers stop a shard at its first bad record. Records are appended whole and flushed, so a
killed writer loses at most the record it was writing; a key seen twice (two runs on two
machines) counts once, the first shard's. Shards of several runs merge by copying the files
into one folder (distinct names: a writer takes the next free number).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Sequence, Tuple

import numpy as np

from ..files import write_atomic

MAGIC = b"DFA1"
HEADER = struct.Struct("<4sQIIIII")  # magic, key, sample, count, flags, temp_milli, crc32
ENDED_ON_EOS = 1
VERSION = 1


def prompt_key(ids: Sequence[int]) -> int:
    """A stable 64-bit name for a prompt: blake2b of its token ids (little-endian uint32)."""
    raw = np.asarray(ids, dtype="<u4").tobytes()
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")


@dataclass
class Record:
    key: int
    sample: int
    tokens: List[int]
    ended: bool  # the answer ended on EOS (the EOS id itself is not stored)
    temperature: float


def _crc(header_without_crc: bytes, payload: bytes) -> int:
    return zlib.crc32(payload, zlib.crc32(header_without_crc)) & 0xFFFFFFFF


def _scan(path: Path, dtype: np.dtype) -> Tuple[List[Record], int]:
    """The whole records of a shard and the byte length they span (a torn tail starts there)."""
    blob = path.read_bytes()
    records, pos = [], 0
    while pos + HEADER.size <= len(blob):
        magic, key, sample, count, flags, temp, crc = HEADER.unpack_from(blob, pos)
        end = pos + HEADER.size + count * dtype.itemsize
        if magic != MAGIC or end > len(blob):
            break
        payload = blob[pos + HEADER.size : end]
        if _crc(HEADER.pack(magic, key, sample, count, flags, temp, 0), payload) != crc:
            break
        tokens = np.frombuffer(payload, dtype=dtype).astype(np.int64).tolist()
        records.append(Record(key, sample, tokens, bool(flags & ENDED_ON_EOS), temp / 1000))
        pos = end
    return records, pos


class AnswerStore:
    """Read and append generated answers; ``open_writer`` starts a new shard."""

    def __init__(self, folder: str | Path, vocab_size: int | None = None):
        self.folder = Path(folder)
        meta_path = self.folder / "store.json"
        if meta_path.exists():
            meta = json.loads(meta_path.read_text())
            if meta.get("version") != VERSION:
                raise ValueError(
                    f"{meta_path}: store version {meta.get('version')} is not {VERSION}"
                )
        else:
            if vocab_size is None:
                raise FileNotFoundError(
                    f"{meta_path} is missing (a new store needs the vocabulary size)"
                )
            meta = {"version": VERSION, "dtype": "uint16" if vocab_size <= 1 << 16 else "uint32"}
            self.folder.mkdir(parents=True, exist_ok=True)
            write_atomic(meta_path, json.dumps(meta))
        self.dtype = np.dtype(meta["dtype"]).newbyteorder("<")

    def shards(self) -> List[Path]:
        return sorted(self.folder.glob("shard-*.bin"))

    def records(self) -> Iterator[Record]:
        """Every whole record, first occurrence of each (key, sample) only, in shard order."""
        seen = set()
        for shard in self.shards():
            for r in _scan(shard, self.dtype)[0]:
                if (r.key, r.sample) not in seen:
                    seen.add((r.key, r.sample))
                    yield r

    def done(self) -> set:
        """The (key, sample) pairs already stored."""
        return {(r.key, r.sample) for r in self.records()}

    def answers(self) -> Dict[Tuple[int, int], Record]:
        return {(r.key, r.sample): r for r in self.records()}

    def open_writer(self) -> "ShardWriter":
        repair(self)  # a crashed writer's torn tail goes before anything new is written
        return ShardWriter(self)


class ShardWriter:
    """Appends records to a fresh shard (the next free number), flushed record by record."""

    def __init__(self, store: AnswerStore):
        self.store = store
        self.path = self._claim()
        self.file = self.path.open("ab")

    def _claim(self) -> Path:
        taken = {p.name for p in self.store.shards()}
        number = 0
        while True:
            path = self.store.folder / f"shard-{number:05d}.bin"
            if path.name not in taken:
                try:
                    path.open("xb").close()  # exclusive create: two writers never share a shard
                    return path
                except FileExistsError:
                    pass
            number += 1

    def append(
        self, key: int, sample: int, tokens: Sequence[int], ended: bool, temperature: float
    ) -> None:
        payload = np.asarray(tokens, dtype=np.int64)
        if payload.size and (payload.min() < 0 or payload.max() > np.iinfo(self.store.dtype).max):
            raise ValueError(f"token id out of range for a {self.store.dtype.name} store")
        payload = payload.astype(self.store.dtype).tobytes()
        fields = (
            MAGIC,
            key,
            sample,
            len(tokens),
            ENDED_ON_EOS if ended else 0,
            round(temperature * 1000),
        )
        crc = _crc(HEADER.pack(*fields, 0), payload)
        # one write: the record is whole or torn
        self.file.write(HEADER.pack(*fields, crc) + payload)
        self.file.flush()

    def sync(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())

    def close(self) -> None:
        if not self.file.closed:
            self.sync()
            self.file.close()
            if self.path.stat().st_size == 0:
                self.path.unlink()  # an empty shard says nothing

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def repair(store: AnswerStore) -> int:
    """Cut every shard's torn tail (a crashed writer's last record); returns bytes removed."""
    removed = 0
    for shard in store.shards():
        size = shard.stat().st_size
        good = _scan(shard, store.dtype)[1]
        if good < size:
            with shard.open("r+b") as f:
                f.truncate(good)
            removed += size - good
    return removed
