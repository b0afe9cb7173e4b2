"""The bytes ``torch.save`` writes around a tensor's data: each tensor item
of a checkpoint region is stored as a complete ``torch.save`` record (the
head, the raw bytes, the tail), so that the region, written to a file byte
for byte, is a ``.distcp`` file that DCP's own FileSystemReader reads
(it ``torch.load``\\ s each tensor item from its slice of the file).

The frames come from ``torch.save`` itself, under
``torch.serialization.skip_data()`` (which leaves the data's place empty and
its zip CRC zero, as torch does for checkpoints filled in later), written to
an object that keeps only what is written around that place. They depend
only on the dtype and the shape, so they are made once per pair."""

from __future__ import annotations

import functools
import io
from typing import List, Tuple

import torch


# Room for one tensor's frames when sizing a region: ~1.6 KiB, more for a
# tensor of many dimensions.
FRAME_ROOM = 4 << 10


class _Recorder(io.RawIOBase):
    """A seekable sink that keeps what is written and remembers the one
    span ``skip_data`` seeks over."""

    def __init__(self) -> None:
        super().__init__()
        self.parts: List[Tuple[int, bytes]] = []
        self.pos = 0
        self.end = 0

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, b: "bytes | bytearray | memoryview") -> int:  # type: ignore[override]
        data = bytes(b)
        self.parts.append((self.pos, data))
        self.pos += len(data)
        self.end = max(self.end, self.pos)
        return len(data)

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.pos = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.end}[whence] + offset
        return self.pos


@functools.lru_cache(maxsize=4096)
def frames(dtype: torch.dtype, shape: Tuple[int, ...]) -> Tuple[bytes, bytes]:
    """(head, tail) of the ``torch.save`` record of a contiguous CPU tensor
    of ``dtype`` and ``shape``: head + its raw bytes + tail is a file that
    ``torch.load(..., weights_only=True)`` reads back as that tensor. The
    head's length is a multiple of 64 (torch aligns the data)."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    stand_in = torch.empty(0, dtype=dtype).set_(torch.UntypedStorage(nbytes), 0, shape)
    sink = _Recorder()
    with torch.serialization.skip_data():
        torch.save(stand_in, sink)
    data_at = _skipped_span(sink, nbytes)
    image = bytearray(sink.end)
    for at, data in sink.parts:
        image[at:at + len(data)] = data
    return bytes(image[:data_at]), bytes(image[data_at + nbytes:])


def _skipped_span(sink: _Recorder, nbytes: int) -> int:
    """Where the data goes: the one gap of ``nbytes`` between the writes
    (for an empty tensor, where torch's reader finds its empty record)."""
    if nbytes == 0:
        image = bytearray(sink.end)
        for at, data in sink.parts:
            image[at:at + len(data)] = data
        return torch._C.PyTorchFileReader(io.BytesIO(bytes(image))).get_record_offset("data/0")
    covered = 0
    for at, data in sorted(sink.parts):
        if at > covered:
            if at - covered != nbytes:
                raise RuntimeError(f"torch.save left a gap of {at - covered} bytes, not {nbytes}")
            return covered
        covered = max(covered, at + len(data))
    raise RuntimeError("torch.save under skip_data() left no room for the data")


def record_length(dtype: torch.dtype, shape: Tuple[int, ...], nbytes: int) -> int:
    head, tail = frames(dtype, tuple(shape))
    return len(head) + nbytes + len(tail)
