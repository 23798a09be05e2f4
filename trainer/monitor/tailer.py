"""Follow a growing file by byte offset, and read the end of a large file (light side).

`Follower` never re-reads what it has read: it keeps the byte offset and the inode, and starts over
(reporting a reset) only when the file is replaced (new inode: rotation) or shrinks below the offset
(truncation). A missing file is not an error: the run may not have started yet. No file handle is kept
open between reads, so a rotated or deleted log is not pinned on disk.

A log's lines are cut at `max_line` bytes (with a marker saying how long the line was) before anyone
decodes, masks or serves them: one 50 MB line then costs what 16 KiB do, and only `max_line` bytes of
it are ever held in memory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

CHUNK = 1 << 20  # one read() call


def cut_line(line: bytes, keep: int, total: int) -> bytes:
    """The first `keep` bytes of a line of `total` bytes, and a marker saying it was cut."""
    return line[:keep] + f" [... line cut: {total:,} bytes in all]".encode()


@dataclass
class Chunk:
    lines: list[bytes] = field(default_factory=list)  # complete lines, newline stripped
    offsets: list[int] = field(default_factory=list)  # byte offset where each line starts
    reset: bool = False  # the file was replaced or truncated: what was read before is void


class Follower:
    """Incremental reader of complete lines.

    `backlog_bytes` (for logs): on first contact, or after a reset, skip to at most this many bytes
    before the end instead of reading a possibly huge file from its start. None reads from byte 0
    (the event stream, whose every line matters)."""

    def __init__(
        self,
        path: Path,
        backlog_bytes: int | None = None,
        max_read: int = CHUNK,
        max_line: int | None = None,
    ):
        self.path = Path(path)
        self.backlog_bytes = backlog_bytes
        self.max_read = max_read
        self.max_line = max_line  # (logs) longer lines are cut (`cut_line`); None keeps every byte
        self.offset = 0
        self.inode: tuple[int, int] | None = None
        self.resets = 0
        self._partial: bytes | None = b""  # the line being read (at most max_line bytes of it)
        self._line_start = 0  # its byte offset in the file
        self._dropped = 0  # bytes of it beyond max_line, not kept

    def _start_over(self, size: int) -> None:
        self.offset = 0
        self._partial, self._line_start, self._dropped = b"", 0, 0
        if self.backlog_bytes is not None and size > self.backlog_bytes:
            self.offset = size - self.backlog_bytes
            self._partial = None  # drop the first (cut) line

    def poll(self) -> Chunk:
        """New complete lines since the last call (at most `max_read` bytes' worth per call)."""
        out = Chunk()
        try:
            st = os.stat(self.path)
        except (FileNotFoundError, NotADirectoryError):
            return out
        ident = (st.st_dev, st.st_ino)
        if self.inode is None:
            self.inode = ident
            self._start_over(st.st_size)
        elif ident != self.inode or st.st_size < self.offset:
            self.inode = ident
            self.resets += 1
            self._start_over(st.st_size)
            out.reset = True
        if st.st_size <= self.offset:
            return out
        try:
            with open(self.path, "rb") as fh:
                if (os.fstat(fh.fileno()).st_dev, os.fstat(fh.fileno()).st_ino) != self.inode:
                    return out  # replaced between stat and open: the next poll resets
                fh.seek(self.offset)
                data = fh.read(min(st.st_size - self.offset, self.max_read))
        except FileNotFoundError:
            return out
        base = self.offset  # the file offset of data[0]
        self.offset += len(data)
        if self._partial is None:  # first read after skipping into the middle of a file
            cut = data.find(b"\n")
            if cut < 0:
                return out
            base += cut + 1
            data = data[cut + 1 :]
            self._partial, self._line_start, self._dropped = b"", base, 0
        kept = len(self._partial)
        buf = self._partial + data  # the kept part of a long line is at most max_line bytes
        pos, start, dropped = 0, self._line_start, self._dropped
        while True:
            nl = buf.find(b"\n", pos)
            if nl < 0:
                break
            line = buf[pos:nl]
            if line.endswith(b"\r"):
                line = line[:-1]
            if self.max_line is not None and (dropped or len(line) > self.max_line):
                line = cut_line(line, self.max_line, dropped + len(line))
            out.lines.append(line)
            out.offsets.append(start)
            pos = nl + 1
            start, dropped = base + pos - kept, 0
        rest = buf[pos:]
        if self.max_line is not None and len(rest) > self.max_line:
            dropped += len(rest) - self.max_line
            rest = rest[: self.max_line]
        self._partial, self._line_start, self._dropped = rest, start, dropped
        return out

    @property
    def pending(self) -> bool:
        """More bytes are on disk than were read (a poll stopped at `max_read`)."""
        try:
            return os.stat(self.path).st_size > self.offset
        except OSError:
            return False


def tail_lines(
    path: Path, n: int, block: int = 64 * 1024, max_bytes: int = 4 << 20, max_line: int | None = None
) -> list[str]:
    """The last `n` complete lines of a file, reading backwards from its end in blocks: the cost depends
    on `n` and the line length, not on the file's size. A missing file gives []. `max_line`: longer
    lines are cut (`cut_line`)."""
    if n <= 0:
        return []
    try:
        with open(path, "rb") as fh:
            end = fh.seek(0, os.SEEK_END)
            pos = end
            data = b""
            while pos > 0 and data.count(b"\n") <= n and end - pos < max_bytes:
                step = min(block, pos)
                pos -= step
                fh.seek(pos)
                data = fh.read(step) + data
    except (FileNotFoundError, NotADirectoryError):
        return []
    if not data.endswith(b"\n"):
        data = data[: data.rfind(b"\n") + 1]  # the last line is still being written
    lines = data.split(b"\n")[:-1]
    if pos > 0:
        lines = lines[1:]  # the first one may be cut
    lines = [ln.rstrip(b"\r") for ln in lines[-n:]]
    if max_line is not None:
        lines = [cut_line(ln, max_line, len(ln)) if len(ln) > max_line else ln for ln in lines]
    return [ln.decode("utf-8", "replace") for ln in lines]
