"""Wheel archives at the byte level: a deterministic zip writer that can copy members raw.

Why not zipfile for writing: the upstream wheel is ~300 MB compressed / ~730 MB unpacked and
almost all of it is copied unchanged. zipfile can only write what it compresses itself, which
costs ~18 s (level 1) to over a minute (level 6) on 2 cores. Copying a member's compressed
bytes as they are takes ~1.5 s for the whole wheel. Reading stays with zipfile (it checks CRCs).

The writer emits plain (non-zip64) archives with fixed timestamps and no extra fields, so the
same inputs always give the same bytes. It refuses archives that would need zip64 (members or
offsets of 4 GiB and more, 65535 members and more); PyPI caps wheels far below that.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import struct
import zipfile
import zlib
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from hdtool.pin import HdError

# DOS date/time of every member: 1980-01-01 00:00:00, the earliest a zip can say, as
# SOURCE_DATE_EPOCH-less reproducible wheel builders use.
_DOS_DATE = (0 << 9) | (1 << 5) | 1
_DOS_TIME = 0
_VERSION_NEEDED = 20  # 2.0: deflate
_VERSION_MADE_BY = (3 << 8) | _VERSION_NEEDED  # 3: unix, so external_attr holds st_mode
_FLAG_UTF8 = 0x800
_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
_CENTRAL_HEADER = struct.Struct("<IHHHHHHIIIHHHHHII")
_END_OF_CENTRAL_DIR = struct.Struct("<IHHHHIIH")
_ZIP32_LIMIT = 0xFFFFFFFF
_CHUNK = 1 << 20

REGULAR_FILE = 0o100644
EXECUTABLE_FILE = 0o100755


def record_hash(data: bytes) -> str:
    """The RECORD form of a sha256: `sha256=` + urlsafe base64 without padding."""
    return hash_to_record(hashlib.sha256(data).digest())


def hash_to_record(digest: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


@dataclass(frozen=True)
class RecordRow:
    path: str
    hash: str  # "sha256=..." or "" (RECORD itself)
    size: str  # decimal or "" (RECORD itself)


def parse_record(text: str, origin: str) -> list[RecordRow]:
    rows = []
    for lineno, fields in enumerate(csv.reader(io.StringIO(text)), start=1):
        if not fields:
            continue
        if len(fields) != 3:
            raise HdError(f"{origin}: line {lineno} has {len(fields)} fields, RECORD rows have 3")
        rows.append(RecordRow(*fields))
    return rows


def format_record(rows: Iterable[RecordRow]) -> bytes:
    out = io.StringIO()
    # "\n" line ends like setuptools/wheel write them (csv defaults to "\r\n").
    writer = csv.writer(out, lineterminator="\n")
    for row in rows:
        writer.writerow([row.path, row.hash, row.size])
    return out.getvalue().encode()


def raw_member_chunks(archive: BinaryIO, info: zipfile.ZipInfo) -> Iterator[bytes]:
    """The member's compressed bytes exactly as stored (no inflate), read from its local header."""
    if info.flag_bits & 0x1:
        raise HdError(f"{info.filename}: encrypted zip member, not a wheel")
    archive.seek(info.header_offset)
    header = archive.read(_LOCAL_HEADER.size)
    fields = _LOCAL_HEADER.unpack(header) if len(header) == _LOCAL_HEADER.size else None
    if fields is None or fields[0] != 0x04034B50:
        raise HdError(f"{info.filename}: bad local file header in the source wheel")
    name_len, extra_len = fields[9], fields[10]
    archive.seek(info.header_offset + _LOCAL_HEADER.size + name_len + extra_len)
    remaining = info.compress_size
    while remaining:
        chunk = archive.read(min(remaining, _CHUNK))
        if not chunk:
            raise HdError(f"{info.filename}: the source wheel ends inside this member")
        remaining -= len(chunk)
        yield chunk


class DeterministicZipWriter:
    """Writes members in the order given, each with fixed metadata; `close()` adds the index."""

    def __init__(self, out: BinaryIO) -> None:
        self._out = out
        self._central: list[bytes] = []
        self._names: set[str] = set()

    def _begin(self, name: str) -> tuple[bytes, int]:
        if name in self._names:
            raise HdError(f"{name}: would be written twice into the wheel")
        if name.startswith("/") or ".." in name.split("/") or name.endswith("/"):
            raise HdError(f"{name}: not a valid wheel member path")
        self._names.add(name)
        return name.encode(), (0 if name.isascii() else _FLAG_UTF8)

    def _write_member(
        self,
        name: str,
        *,
        method: int,
        crc: int,
        compress_size: int,
        file_size: int,
        mode: int,
        chunks: Iterable[bytes],
    ) -> None:
        encoded, flags = self._begin(name)
        offset = self._out.tell()
        if max(offset, compress_size, file_size) >= _ZIP32_LIMIT:
            raise HdError(f"{name}: the wheel would need zip64, which this writer does not emit")
        self._out.write(
            _LOCAL_HEADER.pack(
                0x04034B50,
                _VERSION_NEEDED,
                flags,
                method,
                _DOS_TIME,
                _DOS_DATE,
                crc,
                compress_size,
                file_size,
                len(encoded),
                0,
            )
            + encoded
        )
        written = 0
        for chunk in chunks:
            self._out.write(chunk)
            written += len(chunk)
        if written != compress_size:
            raise HdError(f"{name}: wrote {written} compressed bytes, expected {compress_size}")
        self._central.append(
            _CENTRAL_HEADER.pack(
                0x02014B50,
                _VERSION_MADE_BY,
                _VERSION_NEEDED,
                flags,
                method,
                _DOS_TIME,
                _DOS_DATE,
                crc,
                compress_size,
                file_size,
                len(encoded),
                0,
                0,
                0,
                0,
                (mode & 0xFFFF) << 16,
                offset,
            )
            + encoded
        )

    def copy_raw(self, name: str, source: BinaryIO, info: zipfile.ZipInfo) -> None:
        """Copy a member of another archive as stored, under `name`, keeping its file mode."""
        if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise HdError(
                f"{info.filename}: compression method {info.compress_type} in the "
                "source wheel; wheels use stored or deflate"
            )
        self._write_member(
            name,
            method=info.compress_type,
            crc=info.CRC,
            compress_size=info.compress_size,
            file_size=info.file_size,
            mode=(info.external_attr >> 16) or REGULAR_FILE,
            chunks=raw_member_chunks(source, info),
        )

    def add_bytes(
        self, name: str, data: bytes, *, mode: int = REGULAR_FILE, compresslevel: int = 6
    ) -> None:
        compressor = zlib.compressobj(compresslevel, zlib.DEFLATED, -zlib.MAX_WBITS)
        packed = compressor.compress(data) + compressor.flush()
        self._write_member(
            name,
            method=zipfile.ZIP_DEFLATED,
            crc=zlib.crc32(data),
            compress_size=len(packed),
            file_size=len(data),
            mode=mode,
            chunks=[packed],
        )

    def close(self) -> None:
        start = self._out.tell()
        central = b"".join(self._central)
        self._out.write(central)
        if len(self._central) >= 0xFFFF or start + len(central) >= _ZIP32_LIMIT:
            raise HdError("the wheel would need zip64, which this writer does not emit")
        self._out.write(
            _END_OF_CENTRAL_DIR.pack(
                0x06054B50,
                0,
                0,
                len(self._central),
                len(self._central),
                len(central),
                start,
                0,
            )
        )


def member_digest(archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> tuple[bytes, int]:
    """sha256 digest and size of a member's content (zipfile checks the CRC on the way)."""
    h = hashlib.sha256()
    size = 0
    try:
        with archive.open(info) as fh:
            while chunk := fh.read(_CHUNK):
                h.update(chunk)
                size += len(chunk)
    except (zipfile.BadZipFile, zlib.error, EOFError) as e:
        raise HdError(f"{archive.filename}: {info.filename} is corrupt ({e})") from e
    return h.digest(), size


def open_wheel(path: Path) -> zipfile.ZipFile:
    try:
        archive = zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile) as e:
        raise HdError(f"{path}: not a readable wheel ({e})") from e
    names = [info.filename for info in archive.infolist()]
    dupes = sorted(name for name, count in Counter(names).items() if count > 1)
    if dupes:
        raise HdError(f"{path}: duplicate members {dupes[:5]}")
    return archive
