"""Each step's inputs handed from rank 0 to the other ranks once: the flat int64 arrays the
forward reads (token ids, positions, KV slots, block tables, sequence lengths, query starts,
which rows give logits, the LoRA batch's segments and their adapter slots) written into one
shared-memory buffer, and a 72-byte doorbell on each
rank's control socket saying how long each array is. No pickling on the step's path, one
copy in and one out; the buffer grows (a new one, its descriptor passed along with the
doorbell) when a step outgrows it.

The buffer is rewritten only for the next step, which rank 0 starts after every rank has
passed this step's collectives, so each rank has read its copy by then.

Control messages (load, offload, KV operations, stop) share the socket, pickled: they are rare."""

from __future__ import annotations

import contextlib
import mmap
import os
import pickle
import struct
import tempfile
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle, send_handle
from typing import Any

import torch

# kind, step number, tokens, sequences, block table width, logits rows, flags, buffer bytes,
# LoRA segments (0: no adapter in the step)
HEADER = struct.Struct("<9q")
KIND_STEP, KIND_CALL, KIND_STOP = 1, 2, 3
FLAG_NEW_BUFFER = 1
SHM_DIR = "/dev/shm"  # noqa: S108 - mkstemp's fresh file there, its name removed at once
ARRAYS = ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens", "query_start_loc",
          "logits_indices", "lora_seg_starts", "lora_seg_slots")


def _none() -> torch.Tensor:
    return torch.zeros(0, dtype=torch.long)


@dataclass(slots=True)
class StepArrays:
    """One step's forward inputs, as the model runner built them (int64, on the CPU)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor      # [num_seqs, width]
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    logits_indices: torch.Tensor
    # the LoRA batch (models/linear.py LoRABatch): segment starts [segments + 1] and each
    # segment's adapter slot [segments]; both empty when no token of the step has an adapter
    lora_seg_starts: torch.Tensor = field(default_factory=_none)
    lora_seg_slots: torch.Tensor = field(default_factory=_none)


def _sizes(num_tokens: int, num_seqs: int, width: int, num_logits: int, num_segments: int) -> list[int]:
    return [num_tokens, num_tokens, num_tokens, num_seqs * width, num_seqs, num_seqs + 1, num_logits,
            num_segments + 1 if num_segments else 0, num_segments]


class SharedBuffer:
    """A memory-backed file (in /dev/shm where there is one) mapped by rank 0 and every rank.
    Its name is removed as soon as it is made: the ranks get its descriptor over their
    sockets, so nothing is left behind however the processes end."""

    def __init__(self, fd: int, size: int) -> None:
        self.size = size
        self.map = mmap.mmap(fd, size)

    @classmethod
    def create(cls, size: int) -> tuple[SharedBuffer, int]:
        """The buffer and its open descriptor (to hand to the ranks, then close)."""
        root = SHM_DIR if os.path.isdir(SHM_DIR) else None
        fd, path = tempfile.mkstemp(prefix="lockgate-step-", dir=root)
        os.unlink(path)
        os.ftruncate(fd, size)
        return cls(fd, size), fd

    def tensor(self, count: int) -> torch.Tensor:
        return torch.frombuffer(self.map, dtype=torch.int64, count=count)

    def close(self) -> None:
        self.map.close()


class StepSender:
    """Rank 0's end: `send_step` to every rank, `send_call`/`send_stop` for control."""

    def __init__(self, conns: list[Connection], pids: list[int]) -> None:
        self.conns, self.pids = conns, pids
        self.buffer: SharedBuffer | None = None
        self.num_steps = 0

    def send_step(self, arrays: StepArrays) -> None:
        parts = [getattr(arrays, name).reshape(-1) for name in ARRAYS]
        total = sum(p.numel() for p in parts)
        new_fd = None
        if self.buffer is None or total * 8 > self.buffer.size:
            if self.buffer is not None:
                self.buffer.close()        # each rank keeps its own mapping until it moves on
            self.buffer, new_fd = SharedBuffer.create(max(1 << 16, 2 * total * 8))
        if total:
            flat = self.buffer.tensor(total)
            torch.cat(parts, out=flat)
            del flat                       # no view may outlive a resize
        num_seqs, width = arrays.block_tables.shape
        self.num_steps += 1
        header = HEADER.pack(KIND_STEP, self.num_steps, arrays.input_ids.numel(), num_seqs, width,
                             arrays.logits_indices.numel(), 0 if new_fd is None else FLAG_NEW_BUFFER,
                             self.buffer.size, arrays.lora_seg_slots.numel())
        try:
            for conn, pid in zip(self.conns, self.pids, strict=True):
                conn.send_bytes(header)
                if new_fd is not None:
                    send_handle(conn, new_fd, pid)
        finally:
            if new_fd is not None:
                os.close(new_fd)

    def send_call(self, conn: Connection, method: str, kwargs: dict[str, Any]) -> None:
        conn.send_bytes(HEADER.pack(KIND_CALL, 0, 0, 0, 0, 0, 0, 0, 0) + pickle.dumps((method, kwargs)))

    def send_stop(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):     # that rank is gone already
                conn.send_bytes(HEADER.pack(KIND_STOP, 0, 0, 0, 0, 0, 0, 0, 0))

    def close(self) -> None:
        if self.buffer is not None:
            self.buffer.close()
            self.buffer = None


class StepReceiver:
    """A rank's end: `decode` one message from rank 0 into ("step", StepArrays),
    ("call", (method, kwargs)) or ("stop", None)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.buffer: SharedBuffer | None = None

    def decode(self, message: bytes) -> tuple[str, Any]:
        kind, _num, num_tokens, num_seqs, width, num_logits, flags, size, num_segments = HEADER.unpack_from(message)
        if kind == KIND_STOP:
            return "stop", None
        if kind == KIND_CALL:
            return "call", pickle.loads(message[HEADER.size:])  # noqa: S301 - rank 0's, over a private socketpair
        if flags & FLAG_NEW_BUFFER:
            fd = recv_handle(self.conn)
            try:
                if self.buffer is not None:
                    self.buffer.close()
                self.buffer = SharedBuffer(fd, size)
            finally:
                os.close(fd)
        if self.buffer is None:
            raise RuntimeError("step channel: a step arrived before its buffer")
        sizes = _sizes(num_tokens, num_seqs, width, num_logits, num_segments)
        flat = self.buffer.tensor(sum(sizes)).clone()    # rank 0 reuses the buffer next step
        parts = dict(zip(ARRAYS, torch.split(flat, sizes), strict=True))
        parts["block_tables"] = parts["block_tables"].view(num_seqs, width)
        return "step", StepArrays(**parts)

    def close(self) -> None:
        if self.buffer is not None:
            self.buffer.close()
            self.buffer = None
