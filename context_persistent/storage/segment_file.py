"""One sealed segment's file: plain JSONL, or compressed as concatenated zstd frames, read by offset
(:class:`SegmentFile`) and written (:func:`compress`).

Each zstd frame holds whole records (about ``FRAME_BYTES`` of them), and the manifest (manifest.py) records
a frame index: a random read decompresses one frame. ``zstdcat`` reads such a file as one stream.
``zstandard`` is imported only when a compressed segment is read or written.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Iterator
from pathlib import Path

from ..errors import LogCorruptedError
from .manifest import Segment

#: Uncompressed bytes of whole records per zstd frame of a compressed segment (a frame holds at least one).
FRAME_BYTES = 256 << 10


# -- compression (zstandard, imported lazily) ------------------------------------------------------------
def frame_chunks(data: bytes | memoryview, frame_bytes: int = FRAME_BYTES) -> Iterator[tuple[int, int]]:
    """``(start, end)`` of each frame's uncompressed bytes: whole lines, about ``frame_bytes`` each."""
    view = bytes(data) if isinstance(data, memoryview) else data
    start = 0
    n = len(view)
    while start < n:
        cut = start + frame_bytes
        if cut >= n:
            end = n
        else:
            nl = view.rfind(b"\n", start, cut)
            end = nl + 1 if nl >= start else view.find(b"\n", cut) + 1 or n
        yield start, end
        start = end


def compress(data: bytes, level: int = 3) -> tuple[bytes, tuple[tuple[int, int], ...]]:
    """``data`` (whole records) as concatenated zstd frames, and the frame index."""
    import zstandard

    cctx = zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=True)
    out = bytearray()
    frames: list[tuple[int, int]] = []
    for start, end in frame_chunks(data):
        frames.append((start, len(out)))
        out += cctx.compress(data[start:end])
    return bytes(out), tuple(frames)


def decompress_frame(frame: bytes, size: int) -> bytes:
    import zstandard

    return zstandard.ZstdDecompressor().decompress(frame, max_output_size=size)


def decompress_all(data: bytes) -> bytes:
    """Every frame of ``data`` (as ``zstdcat`` reads it)."""
    import zstandard

    return zstandard.ZstdDecompressor().decompressobj(read_across_frames=True).decompress(data)


# -- reading ----------------------------------------------------------------------------------------------
class SegmentFile:
    """Read access to one sealed segment's uncompressed bytes by offset inside the segment."""

    def __init__(self, directory: Path, seg: Segment, fd: int) -> None:
        self.seg = seg
        self.fd = fd
        self.directory = directory
        self._frame_starts = [u for u, _ in seg.compressed.frames] if seg.compressed else []
        self._cached: tuple[int, bytes] | None = None

    @property
    def path(self) -> Path:
        return self.directory / self.seg.file

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def drop_cache(self) -> None:
        """Forget the frame kept for nearby reads (a reader done with this segment)."""
        self._cached = None

    def frame(self, i: int) -> bytes:
        """The uncompressed bytes of frame ``i`` (compressed segments)."""
        if self._cached is not None and self._cached[0] == i:
            return self._cached[1]
        comp = self.seg.compressed
        assert comp is not None
        frames = comp.frames
        c0 = frames[i][1]
        c1 = frames[i + 1][1] if i + 1 < len(frames) else comp.size
        u1 = frames[i + 1][0] if i + 1 < len(frames) else self.seg.size
        raw = os.pread(self.fd, c1 - c0, c0)
        try:
            data = decompress_frame(raw, u1 - frames[i][0])
        except Exception as e:  # zstandard.ZstdError: a damaged frame
            raise LogCorruptedError(str(self.path), 0, c0, f"zstd frame {i} cannot be decompressed ({e}); "
                                                           "`context-persistent verify` checks every segment") from None
        if len(data) != u1 - frames[i][0]:
            raise LogCorruptedError(str(self.path), 0, c0, f"zstd frame {i} holds {len(data)} bytes, the "
                                                           f"manifest says {u1 - frames[i][0]}")
        self._cached = (i, data)
        return data

    def chunks(self, offset: int = 0) -> Iterator[tuple[int, bytes]]:
        """``(segment offset, bytes)`` pieces of the segment from ``offset`` to its end."""
        size = self.seg.size
        if self.seg.compressed is None:
            pos = offset
            while pos < size:
                data = os.pread(self.fd, min(1 << 20, size - pos), pos)
                if not data:
                    raise LogCorruptedError(str(self.path), 0, pos, f"the file ends at byte {pos}; the manifest "
                                                                    f"says it holds {size}")
                yield pos, data
                pos += len(data)
            return
        i = max(0, bisect.bisect_right(self._frame_starts, offset) - 1)
        for j in range(i, len(self._frame_starts)):
            data = self.frame(j)
            u0 = self._frame_starts[j]
            if j == i and offset > u0:
                yield offset, data[offset - u0:]
            else:
                yield u0, data

    def line_at(self, offset: int) -> bytes:
        """The line (with its newline) that starts at segment offset ``offset``."""
        if self.seg.compressed is None:  # a few KiB at a time: most records are small
            want = 4096
            while True:
                data = os.pread(self.fd, min(want, self.seg.size - offset), offset)
                nl = data.find(b"\n")
                if nl >= 0 or len(data) < want:
                    return data[:nl + 1] if nl >= 0 else data
                want *= 16
        out = bytearray()
        for _, data in self.chunks(offset):
            nl = data.find(b"\n")
            if nl >= 0:
                out += data[:nl + 1]
                return bytes(out)
            out += data
        return bytes(out)

    def line_ending_at(self, offset: int) -> bytes:
        """The line that ends exactly at segment offset ``offset`` (``offset`` follows a newline)."""
        if self.seg.compressed is not None:
            i = max(0, bisect.bisect_right(self._frame_starts, offset - 1) - 1)
            data = self.frame(i)[: offset - self._frame_starts[i]]
            start = data.rfind(b"\n", 0, len(data) - 1) + 1
            return data[start:]  # (frames hold whole lines: the line starts inside this frame)
        back = 0
        while True:
            back = min(offset, max(back * 16, 4096))
            chunk = os.pread(self.fd, back, offset - back)
            start = chunk.rfind(b"\n", 0, len(chunk) - 1) + 1
            if start > 0 or back == offset:
                return chunk[start:]


__all__ = ["FRAME_BYTES", "SegmentFile", "compress", "decompress_all", "decompress_frame", "frame_chunks"]
