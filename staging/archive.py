"""Tar archives as staging sources: kinds, member listing, and the safety check.

Every member list is validated as a whole (``check_members``, a pure function) before any
member is placed in DEST, so an archive with one hostile member is rejected entirely (members
written ahead of the check stay hidden in DEST's temp space and are deleted).
Uncompressed tars are indexed by seeking over headers: each member is a byte range of the
archive that the copy engine reads in parallel. Compressed tars (gzip, zstd) are scanned once
to validate, then extracted in one sequential pass.
"""

from __future__ import annotations

import errno
import gzip
import os
import posixpath
import tarfile
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, BinaryIO

import zstandard

from staging.directio import DirectReader, fs_type
from staging.prefetch import AheadReader, Held, HeldReader

__all__ = [
    "ArchiveError",
    "Member",
    "StrictInfo",
    "archive_kind",
    "check_members",
    "list_members",
    "mtime_ns",
    "normalize_name",
    "open_stream",
    "unpack_note",
]

RESERVED = ".datastore"
MTIME_MAX = 2**63 // 10**9 - 1
"""The latest modification time (and before 1970 the earliest), in seconds, whose ns fit 64
bits (``os.utime``, ``st_mtime_ns``); a tar's base-256 fields go far beyond."""
_SUFFIXES = {".tar": "tar", ".tar.gz": "gz", ".tgz": "gz", ".tar.zst": "zst", ".tzst": "zst"}
_MAGIC = {"gz": b"\x1f\x8b", "zst": b"\x28\xb5\x2f\xfd"}
_NOT_UNPACKED = (".tar.xz", ".txz", ".tar.bz2", ".tbz2", ".tbz", ".tar.lz4", ".tar.lzma", ".tar.lz")


class ArchiveError(Exception):
    """An archive that must not be (or cannot be) unpacked; names the archive and member."""

    def __init__(self, archive: str, reason: str, member: str | None = None):
        self.archive, self.reason, self.member = archive, reason, member
        where = f"member {member!r}: " if member is not None else ""
        super().__init__(f"{archive}: {where}{reason}")


@dataclass(frozen=True)
class Member:
    """One tar member, its name already normalized.

    ``kind`` is ``"file"``, ``"dir"``, ``"symlink"``, ``"hardlink"`` or ``"special"``.
    ``offset`` is where its data starts in an uncompressed archive (``None`` when compressed).
    ``mtime`` is in whole seconds (the header's), ``mtime_ns`` exact (a pax header's fraction).
    """

    name: str
    kind: str
    size: int = 0
    mtime: int = 0
    mtime_ns: int = 0
    mode: int = 0o644
    link: str = ""
    offset: int | None = None
    sparse: bool = False


def archive_kind(path: str) -> str | None:
    """``"tar"``, ``"gz"`` or ``"zst"`` from the file name; ``None`` if not an archive."""
    low = path.lower()
    for suffix, kind in _SUFFIXES.items():
        if low.endswith(suffix):
            return kind
    return None


def unpack_note(path: str) -> str | None:
    """What to say of a tar compressed in a way staging does not unpack (``.tar.xz``,
    ``.tar.bz2``, ...; it is copied as a file, which said nothing), else ``None``."""
    if not path.lower().endswith(_NOT_UNPACKED):
        return None
    return f"{path}: copied as a file, not unpacked (only .tar, .tar.gz/.tgz, .tar.zst/.tzst are)"


def normalize_name(raw: str) -> str:
    """Strip ``./`` and repeated slashes; keep ``..`` and a leading ``/`` for the check to see."""
    lead = "/" if raw.startswith("/") else ""
    parts = [p for p in raw.split("/") if p not in ("", ".")]
    return lead + "/".join(parts)


def _resolve(path: str, symlinks: dict[str, str], depth: int = 0) -> str | None:
    """Resolve ``path`` inside DEST, following symlink members; ``None`` if it leaves DEST."""
    if depth > 40:
        return None
    out: list[str] = []
    parts = path.split("/")
    for i, part in enumerate(parts):
        if part in ("", "."):
            continue
        if part == "..":
            if not out:
                return None
            out.pop()
            continue
        out.append(part)
        here = "/".join(out)
        if here in symlinks:
            target = symlinks[here]
            if target.startswith("/"):
                return None
            base = posixpath.dirname(here)
            rest = "/".join(parts[i + 1 :])
            joined = posixpath.join(base, target, rest) if rest else posixpath.join(base, target)
            return _resolve(joined, symlinks, depth + 1)
    return "/".join(out)


def check_members(archive: str, members: list[Member]) -> None:
    """Raise ``ArchiveError`` naming the first member that could write outside DEST or clobber.

    Rejected: absolute names, ``..`` components, the reserved ``.datastore`` directory, device
    and FIFO nodes, modification times out of range (:data:`MTIME_MAX`), symlinks resolving
    outside DEST, hardlinks to anything but an earlier regular member, members whose path runs
    through a symlink member, and a non-directory member whose name is another member's
    directory.
    """
    symlinks: dict[str, str] = {}
    files_seen: set[str] = set()
    for m in members:
        name = m.name
        if name.startswith("/"):
            raise ArchiveError(archive, "absolute path", name)
        parts = name.split("/")
        if ".." in parts:
            raise ArchiveError(archive, "'..' path component", name)
        if parts[0] == RESERVED:
            raise ArchiveError(archive, f"writes into the reserved {RESERVED}/ directory", name)
        if m.kind == "special":
            raise ArchiveError(archive, "device or FIFO node", name)
        if abs(m.mtime) > MTIME_MAX:
            raise ArchiveError(archive, f"modification time {m.mtime} out of range", name)
        for i in range(1, len(parts)):
            parent = "/".join(parts[:i])
            if parent in symlinks:
                raise ArchiveError(archive, f"path runs through symlink member {parent!r}", name)
        if m.kind == "symlink":
            if m.link.startswith("/"):
                raise ArchiveError(archive, f"symlink to absolute path {m.link!r}", name)
            target = posixpath.join(posixpath.dirname(name), m.link)
            if _resolve(target, symlinks) is None:
                raise ArchiveError(archive, f"symlink {m.link!r} points outside DEST", name)
            symlinks[name] = m.link
        elif m.kind == "hardlink":
            link = normalize_name(m.link)
            if link not in files_seen:
                raise ArchiveError(
                    archive, f"hardlink to {m.link!r}, not an earlier file of this archive", name
                )
        if m.kind in ("file", "hardlink"):
            files_seen.add(name)
    for name, link in symlinks.items():  # a later symlink member can redirect an earlier one
        if _resolve(posixpath.join(posixpath.dirname(name), link), symlinks) is None:
            raise ArchiveError(archive, f"symlink {link!r} points outside DEST", name)
    dirs = {m.name for m in members if m.kind == "dir"}
    for m in members:
        parts = m.name.split("/")
        dirs.update("/".join(parts[:i]) for i in range(1, len(parts)))
    for m in members:
        if m.kind != "dir" and m.name in dirs:
            raise ArchiveError(archive, "would overwrite a directory of another member", m.name)


class StrictInfo(tarfile.TarInfo):
    """A tar header that fails on a corrupt or cut header anywhere in the archive: tarfile
    takes any but the first for the end of the archive, so the members after it would be
    lost without a word (GNU tar exits 2). Zeros cut short still end it."""

    @classmethod
    def frombuf(cls, buf: bytes, encoding: str, errors: str) -> tarfile.TarInfo:
        try:
            return super().frombuf(buf, encoding, errors)
        except (tarfile.TruncatedHeaderError, tarfile.InvalidHeaderError) as exc:
            if not buf.strip(b"\0"):
                raise
            raise tarfile.ReadError(str(exc)) from None


def mtime_ns(info: tarfile.TarInfo) -> int:
    """A member's modification time in ns: a pax header's decimal exactly (tarfile keeps it
    as a float, ``1795955300.016684686`` as ``...0166848``), else the header's seconds."""
    text = info.pax_headers.get("mtime", "")
    whole, _, frac = text.lstrip("-").partition(".")
    if not (whole.isdigit() and (frac.isdigit() or not frac)):
        return int(info.mtime) * 10**9
    ns = int(whole) * 10**9 + int(frac[:9].ljust(9, "0"))
    return -ns if text.startswith("-") else ns


def _member(info: tarfile.TarInfo, offsets: bool) -> Member | None:
    name = normalize_name(info.name)
    if not name:
        return None  # the archive's "./" root entry
    if info.isdir():
        kind = "dir"
    elif info.issym():
        kind = "symlink"
    elif info.islnk():
        kind = "hardlink"
    elif info.isreg():
        kind = "file"
    else:
        kind = "special"
    return Member(
        name=name,
        kind=kind,
        size=info.size if kind == "file" else 0,
        mtime=int(info.mtime),
        mtime_ns=mtime_ns(info),
        mode=info.mode & 0o7777,
        link=info.linkname,
        offset=info.offset_data if offsets and kind == "file" else None,
        sparse=info.issparse(),
    )


@contextmanager
def open_stream(path: str, kind: str) -> Iterator[BinaryIO]:
    """The decompressed byte stream of a ``"gz"`` or ``"zst"`` archive."""
    with open(path, "rb") as raw:
        magic = raw.read(4)
        raw.seek(0)
        if not magic.startswith(_MAGIC[kind]):
            raise ArchiveError(path, f"corrupt or truncated archive (not a {kind} file: bad magic)")
        if kind == "gz":
            with gzip.GzipFile(fileobj=raw, mode="rb") as stream:
                yield stream
        else:
            dctx = zstandard.ZstdDecompressor()
            with dctx.stream_reader(raw, read_across_frames=True, closefd=False) as stream:
                yield stream


DECODE_ERRORS = (tarfile.TarError, EOFError, zlib.error, zstandard.ZstdError, gzip.BadGzipFile)


def zst_truncated(path: str) -> bool:
    """Whether a zstd frame of ``path`` is cut short (which zstandard's stream reader takes
    for the end of the data). Walks the frame and block headers only."""
    with open(path, "rb") as f:
        fd, pos = f.fileno(), 0
        size = os.fstat(fd).st_size
        while pos < size:
            head = os.pread(fd, 18, pos)  # the longest frame header
            if len(head) < 4:
                return True  # less than a magic number
            magic = int.from_bytes(head[:4], "little")
            if magic & 0xFFFFFFF0 == 0x184D2A50:  # a skippable frame: its size follows
                pos += 8 + int.from_bytes(head[4:8], "little")
                continue
            if head[:4] != _MAGIC["zst"]:
                return False  # not a frame: corrupt, as the decoder says
            try:
                pos += zstandard.frame_header_size(head)
            except zstandard.ZstdError:
                return True  # the header itself is cut
            checksum, last = head[4] & 0x04, False
            while not last:
                block = os.pread(fd, 3, pos)
                if len(block) < 3:
                    return True
                h = int.from_bytes(block, "little")
                last, rle = bool(h & 1), (h >> 1) & 3 == 1  # an RLE block holds one byte
                pos += 3 + (1 if rle else h >> 3)
            pos += 4 if checksum else 0
        return pos > size


def _walk_reader(path: str, direct: bool, held: bool, io: str) -> BinaryIO:
    """The reader of an uncompressed tar's walk (:func:`list_members`)."""
    if direct:
        return DirectReader(path)
    if not held:
        return AheadReader(path)
    fuse = io == "auto" and fs_type(path).startswith("fuse")
    try:
        return HeldReader(path, direct=fuse)
    except OSError as exc:
        if not fuse or exc.errno != errno.EINVAL:
            raise
        return HeldReader(path)  # this FUSE filesystem refuses O_DIRECT


def _hand_over(on_member: Callable[[Member, Held | None], None], m: Member, raw: Any) -> None:
    """Call ``on_member`` with ``m`` and its bytes held where the reader holds them; the
    callee releases them (at once if it raises)."""
    held = raw.hold(m.offset, m.size) if isinstance(raw, HeldReader) else None
    try:
        on_member(m, held)
    except BaseException:
        if held is not None:
            held.release()
        raise


def list_members(
    path: str,
    kind: str,
    size: int,
    direct: bool = False,
    on_member: Callable[[Member, Held | None], None] | None = None,
    io: str = "auto",
) -> list[Member]:
    """Every member of the archive at ``path`` (``size`` bytes), validated by ``check_members``.

    ``direct``: walk the headers of an uncompressed tar with ``O_DIRECT`` reads; else they
    are read with the archive read ahead (``staging.prefetch``).
    ``on_member``: called with each regular member of an uncompressed tar as the walk finds
    it, before the archive as a whole is known good (``staging.copy.Engine.ahead``), and,
    unless ``direct``, its bytes read ahead with the walk's and held in memory until the
    callee releases them (``HeldReader``: read with ``O_DIRECT`` from a FUSE filesystem
    under ``io="auto"``); without ``on_member`` they go to the page cache (``AheadReader``).

    Raises ``ArchiveError`` for truncated or corrupt archives as well as unsafe ones.
    """
    members: list[Member] = []
    error: Exception | None = None
    try:
        if kind == "tar":
            raw = _walk_reader(path, direct, on_member is not None, io)
            with raw, tarfile.open(fileobj=raw, mode="r:", tarinfo=StrictInfo) as tf:
                for info in tf:
                    m = _member(info, offsets=True)
                    if m is None:
                        continue
                    # (a sparse member's size is its holes' too: tarfile's next step checks it)
                    if m.kind == "file" and not m.sparse and m.offset + m.size > size:
                        raise ArchiveError(
                            path, "corrupt or truncated archive: data runs past end of file", m.name
                        )
                    members.append(m)
                    if on_member is not None and m.kind == "file" and not m.sparse:
                        _hand_over(on_member, m, raw)
        else:
            with (
                open_stream(path, kind) as stream,
                tarfile.open(fileobj=stream, mode="r|", tarinfo=StrictInfo) as tf,
            ):
                for info in tf:
                    m = _member(info, offsets=False)
                    if m is not None:
                        members.append(m)
    except DECODE_ERRORS as exc:
        error = exc
    if kind == "zst" and zst_truncated(path):  # the decoder may just stop where the bytes do
        raise ArchiveError(path, "truncated archive (the zstd stream ends inside a frame)")
    if error is not None:
        raise ArchiveError(
            path, f"corrupt or truncated archive ({error or type(error).__name__})"
        ) from error
    if not members:
        raise ArchiveError(path, "no members: empty, corrupt or not a tar archive")
    check_members(path, members)
    return members
