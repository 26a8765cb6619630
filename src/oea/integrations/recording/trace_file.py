"""An ``oea-trace`` file that grows while an engine serves: rows are written as they come, the header and
the JSON sidecar when it is finished (``TraceFileWriter``), so recording never holds the trace in memory.

Shape legend: T = recorded tokens, L = recorded MoE layers, N = routed experts, k = top-k.

The file is a plain ``.safetensors`` file (the format of ``oea.traces``; ``docs/traces.md``). Safetensors
stores each tensor as one contiguous byte range, but every tensor of a trace grows with T. The writer
therefore gives each tensor a region sized for the most tokens the size cap allows (``capacity``) and
writes row t of tensor i at ``region_i + t * row_bytes_i``; the regions past the first stay sparse on
disk until ``finish`` moves them down behind the first (only the small tensors move: request ids,
positions and step ids, or the ids of a top-k recording), truncates the file and writes the header into
the space reserved at its start.

The file is made loadable while it grows: it is sized up front (sparse) and ``checkpoint`` writes a header
that names each tensor's written rows and fills the gaps between them with padding tensors (``_pad<i>``,
bytes that the loader skips), then the sidecar. An engine that kills its workers at shutdown (vLLM's
default stops them with SIGKILL) leaves the trace of its last checkpoint; a file killed before its first
checkpoint has no sidecar, and ``oea`` refuses to load it instead of reading half-written rows.

The format's names (the sidecar's keys, the padding prefix) come from ``oea.trace_schema``, which
``oea.traces`` reads by too; every finished file is loaded and validated by ``oea.traces`` in the tests.
"""

from __future__ import annotations

import json
import os
import pathlib
import struct
from dataclasses import dataclass
from typing import Any

import torch

from oea.routing import RouterSpec
from oea.trace_schema import PAD_PREFIX, sidecar, sidecar_path

HEADER_BYTES = 4096  # 8-byte length + JSON header padded with spaces; tensor data starts here
COPY_CHUNK = 8 * 2**20
_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int32: "I32",
           torch.uint8: "U8", torch.int16: "I16"}


@dataclass(frozen=True)
class Column:
    """One tensor of the trace: ``name``, its per-token shape (``()`` for [T], ``(L, N)`` for [T, L, N]), dtype."""

    name: str
    row_shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def row_bytes(self) -> int:
        count = 1
        for size in self.row_shape:
            count *= size
        return count * torch.empty((), dtype=self.dtype).element_size()


class TraceFileWriter:
    """Writes one trace: ``append`` token rows (in the columns' order), then ``finish`` once.

    Args:
        path: the ``.safetensors`` file (replaced; an old sidecar next to it is removed at once).
        columns: the per-token tensors; the first is written in place and should be the largest.
        max_bytes: size cap of the finished file (header included); ``capacity`` tokens fit in it.
        fixed: tensors that do not grow with T (``correction_bias`` [L, N]), written at the end.

    Raises ``OSError`` when the file cannot be created and ``ValueError`` when not even one token fits.
    """

    def __init__(self, path: str | os.PathLike[str], columns: list[Column], max_bytes: int,
                 fixed: dict[str, torch.Tensor] | None = None) -> None:
        self.path = pathlib.Path(path)
        self.columns = columns
        self.fixed = {name: tensor.detach().cpu().contiguous() for name, tensor in (fixed or {}).items()}
        fixed_bytes = sum(t.numel() * t.element_size() for t in self.fixed.values())
        token_bytes = sum(c.row_bytes for c in columns)
        self.capacity = (max_bytes - HEADER_BYTES - fixed_bytes) // token_bytes
        if self.capacity < 1:
            raise ValueError(f"a size cap of {max_bytes} bytes holds no token ({token_bytes} bytes each)")
        self.regions = [HEADER_BYTES + sum(c.row_bytes for c in columns[:i]) * self.capacity
                        for i in range(len(columns))]
        self._fixed_at = HEADER_BYTES + token_bytes * self.capacity  # the fixed tensors, at the end
        self.tokens = 0
        self.checkpointed = 0  # tokens the file's header and sidecar describe
        self.sidecar = sidecar_path(self.path)
        self.sidecar.unlink(missing_ok=True)
        # unbuffered: a failed write (a full disk) leaves nothing queued in Python that a later write would retry
        self._file = open(self.path, "w+b", buffering=0)  # noqa: SIM115 - held open while recording
        self._write_at(0, b"\0" * HEADER_BYTES)
        offset = self._fixed_at
        for tensor in self.fixed.values():
            self._write_at(offset, _bytes(tensor))
            offset += tensor.numel() * tensor.element_size()
        self._file.truncate(self._fixed_at + fixed_bytes)  # its final length while it grows (sparse)

    def fits(self, tokens: int) -> bool:
        """Whether ``tokens`` more tokens stay within the size cap."""
        return self.tokens + tokens <= self.capacity

    def append(self, rows: dict[str, torch.Tensor]) -> None:
        """Write M token rows: ``rows[name]`` is [M, *row_shape] in the column's dtype (CPU, contiguous).

        The token count advances only when every column is written, so after an ``OSError`` (a full disk)
        the file still ends at the last whole step.
        """
        count = None
        for column, region in zip(self.columns, self.regions, strict=True):
            data = rows[column.name]
            if data.dtype != column.dtype or tuple(data.shape[1:]) != column.row_shape:
                raise ValueError(f"{column.name}: expected [M, {column.row_shape}] {column.dtype}, got "
                                 f"{tuple(data.shape)} {data.dtype}")
            if count is not None and data.shape[0] != count:
                raise ValueError(f"{column.name}: {data.shape[0]} rows, other columns {count}")
            count = int(data.shape[0])
            self._write_at(region + self.tokens * column.row_bytes, _bytes(data))
        self.tokens += count or 0

    def checkpoint(self, meta: dict[str, Any], spec: RouterSpec) -> None:
        """Make the file as it stands a loadable trace of the tokens written so far, in place: a header names
        each column's rows and pads the gaps (``_pad<i>``), then the sidecar is replaced. Rows appended later
        are not described until the next checkpoint or ``finish``."""
        header = self._checkpoint_header(self.tokens)
        self._write_header(header)
        self._write_sidecar(meta, spec, self.tokens, [n for n in header if not n.startswith(PAD_PREFIX)])
        self.checkpointed = self.tokens

    def finish_in_place(self, meta: dict[str, Any], spec: RouterSpec) -> pathlib.Path:
        """Finish after a write error (a full disk, a removed folder): the file as it stands becomes the trace
        of its whole tokens, as a checkpoint does, so nothing is moved and no space is needed but the
        sidecar's. When even the sidecar cannot be written, the header goes back to the last checkpoint's
        tokens (which its sidecar still describes) and the ``OSError`` is raised."""
        try:
            self.checkpoint(meta, spec)
        except OSError:
            if self.checkpointed:
                self._write_header(self._checkpoint_header(self.checkpointed))
            raise
        finally:
            self._file.close()
        return self.path

    def _checkpoint_header(self, t: int) -> dict[str, Any]:
        """The header of a checkpoint of the first ``t`` tokens: each column's rows, padding between them."""
        header: dict[str, Any] = {}
        ends = [*self.regions[1:], self._fixed_at]
        for i, (column, region, end) in enumerate(zip(self.columns, self.regions, ends, strict=True)):
            used = region + t * column.row_bytes
            header[column.name] = {"dtype": _DTYPES[column.dtype], "shape": [t, *column.row_shape],
                                   "data_offsets": [region - HEADER_BYTES, used - HEADER_BYTES]}
            if end > used:
                header[f"{PAD_PREFIX}{i}"] = {"dtype": "U8", "shape": [end - used],
                                              "data_offsets": [used - HEADER_BYTES, end - HEADER_BYTES]}
        offset = self._fixed_at
        for name, tensor in self.fixed.items():
            size = tensor.numel() * tensor.element_size()
            header[name] = {"dtype": _DTYPES[tensor.dtype], "shape": list(tensor.shape),
                            "data_offsets": [offset - HEADER_BYTES, offset + size - HEADER_BYTES]}
            offset += size
        return header

    def finish(self, meta: dict[str, Any], spec: RouterSpec) -> pathlib.Path:
        """Compact the regions, write the header and the sidecar (``meta`` plus the format's own fields)."""
        f, t = self._file, self.tokens
        self.sidecar.unlink(missing_ok=True)  # a checkpoint's sidecar no longer describes the file from here on
        offset = HEADER_BYTES
        header: dict[str, Any] = {}
        for column, region in zip(self.columns, self.regions, strict=True):
            size = t * column.row_bytes
            if region != offset:
                self._move(region, offset, size)
            header[column.name] = {"dtype": _DTYPES[column.dtype], "shape": [t, *column.row_shape],
                                   "data_offsets": [offset - HEADER_BYTES, offset + size - HEADER_BYTES]}
            offset += size
        for name, tensor in self.fixed.items():
            size = tensor.numel() * tensor.element_size()
            self._write_at(offset, _bytes(tensor))
            header[name] = {"dtype": _DTYPES[tensor.dtype], "shape": list(tensor.shape),
                            "data_offsets": [offset - HEADER_BYTES, offset + size - HEADER_BYTES]}
            offset += size
        f.truncate(offset)
        self._write_header(header)
        f.close()
        self._write_sidecar(meta, spec, t, list(header))
        return self.path

    def _write_header(self, header: dict[str, Any]) -> None:
        text = json.dumps(header, separators=(",", ":")).encode()
        if len(text) > HEADER_BYTES - 8:
            raise ValueError(f"trace header of {len(text)} bytes does not fit the {HEADER_BYTES - 8} reserved")
        self._write_at(0, struct.pack("<Q", HEADER_BYTES - 8) + text + b" " * (HEADER_BYTES - 8 - len(text)))

    def _write_at(self, offset: int, data: bytes | memoryview) -> None:
        """Write all of ``data`` at ``offset`` (``os.pwrite`` until done; an ``OSError`` such as a full disk
        propagates)."""
        view, fd = memoryview(data).cast("B"), self._file.fileno()
        while view:
            written = os.pwrite(fd, view, offset)
            view, offset = view[written:], offset + written

    def _move(self, source: int, target: int, size: int) -> None:
        """Copy ``size`` bytes from ``source`` to a lower ``target`` in the file, front to back (safe for
        overlapping ranges because each chunk is read before anything at or after it is written)."""
        done, fd = 0, self._file.fileno()
        while done < size:
            chunk = os.pread(fd, min(COPY_CHUNK, size - done), source + done)
            self._write_at(target + done, chunk)
            done += len(chunk)

    def _write_sidecar(self, meta: dict[str, Any], spec: RouterSpec, tokens: int, tensors: list[str]) -> None:
        """The sidecar, replaced in one rename (a reader never sees half of it)."""
        fields = sidecar(meta, spec, tokens, _num_layers(self.columns), tensors)
        partial = self.sidecar.with_suffix(".json.tmp")
        try:
            partial.write_text(json.dumps(fields, indent=2, sort_keys=True) + "\n")
            os.replace(partial, self.sidecar)
        except OSError:
            partial.unlink(missing_ok=True)  # never leave half a sidecar behind (a full disk)
            raise

    def discard(self) -> None:
        """Close and remove the unfinished file (frees a full disk when finishing failed)."""
        if not self._file.closed:
            self._file.close()
        self.path.unlink(missing_ok=True)
        self.sidecar.unlink(missing_ok=True)

    @property
    def closed(self) -> bool:
        return self._file.closed


def _num_layers(columns: list[Column]) -> int:
    return next(c.row_shape[0] for c in columns if len(c.row_shape) == 2)


def _bytes(tensor: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a CPU tensor (bfloat16 included), without a copy."""
    return memoryview(tensor.contiguous().view(torch.uint8).numpy())

