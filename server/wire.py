"""How messages cross between a frontend and an engine: a Unix stream socket per pair, each
message a list of frames with its sizes in front, read and written by the event loop.

Why not zmq, which carried them until issue 19's thirty-fifth session: libzmq moves every
message through an I/O thread of its own on each side, two more threads to wake per
direction. Between calls 10 ms apart (clicks at 100/s) those threads have gone to sleep,
and on the H200 hosts a round trip took 0.60-0.62 ms at the median through zmq against
0.27-0.28 ms through a plain Unix socket, both ends on asyncio loops as the service's are
(`python -m bench.ipc_roundtrip`, docs/BENCHMARKS.md). A click's transport is one round
trip. The event loop writes to the socket and is woken by it directly; the kernel's
socket buffer and the loop's transport queue what is not read yet (the transport's
high-water mark is not waited on: a call waits in the engine's intake, which refuses what
it reads too late, `server.messages.INTAKE_LAG_S`, not in a frontend).

A message on the stream: its frame count `n` (uint32), the `n` frame sizes (uint32 each),
then the frames. Frames are what `server.messages.dump` makes: the call's id and a pickle
and its out-of-band buffers (arrays travel without being pickled into the payload).

Addresses keep the `ipc://<path>` form the supervisor gives every engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

COUNT = struct.Struct("<I")
MAX_FRAMES = 4096  # far above any message here (a pickle and its buffers): a corrupt stream
# A peer that reads nothing while this much waits for it is not reading: what is sent to it
# is dropped (as a zmq ROUTER dropped it at the queue's limit) rather than held
MAX_QUEUED_BYTES = 256 * 1024 * 1024

# Each end asks the kernel for this much room for what it has written and its peer has not
# read yet (Linux caps it at twice net.core.wmem_max; 4 MiB on the CPU machine). With the
# default 208 KiB three 64 KB replies (random weights' noise masks) filled a frontend's
# connection: every further three waited for a turn of the frontend's loop and then one of
# the engine's, both contending for their GILs; clicks at 3,000/s collapsed so on an H200
# (docs/BENCHMARKS.md, issue 19's thirty-fifth session). In `python -m bench.ipc_load`
# (600 replies/s of 64 KB to readers holding the GIL 2 ms a reply; CPU machine, two runs)
# the wait's p99 was 465 and 272 ms with this room, 964 and 627 with the default, 403 and
# 375 through zmq. 0 keeps the kernel's default (the bench's `unix-small`).
SEND_BUFFER_BYTES = 4 * 1024 * 1024

Frame = bytes | bytearray | memoryview


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop the engine's end runs on: uvloop's where it is installed (uvicorn's
    `standard` extra brings it), as the frontends' uvicorn picks it; None: asyncio's own.

    Since the loop reads and writes the frontends' sockets itself, the engine's loop CPU a
    call fell 5-38% with uvloop and the p99 of classify and clicks at 1,000/s halved
    (`python -m bench.engine_loop --kinds classify click --rates 1000 50 --clients 2
    --stub-ms 1`, the loop switched between the two by hand, 2-core CPU machine, two runs
    each, 2026-11-29; docs/BENCHMARKS.md, issue 19's thirty-fifth session)."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def socket_path(address: str) -> str:
    """The file of an `ipc://<path>` address (a bare path is taken as it is)."""
    return address.removeprefix("ipc://")


def framed(messages: Sequence[Sequence[Frame]]) -> list[Frame]:
    """Messages as the stream carries them, in order: each one's frame count and sizes
    (`COUNT` each), then its frames as they are (not copied)."""
    parts: list[Frame] = []
    for frames in messages:
        sizes = [f.nbytes if isinstance(f, memoryview) else len(f) for f in frames]
        parts.append(struct.pack(f"<I{len(sizes)}I", len(sizes), *sizes))
        parts.extend(frames)
    return parts


class Framed(asyncio.Protocol):
    """One end of a connection: whole messages to `on_message(self, frames)`, in order;
    `on_lost(self)` once the connection ends."""

    def __init__(
        self,
        on_message: Callable[[Framed, list[bytes]], None],
        on_lost: Callable[[Framed], None] | None = None,
    ) -> None:
        self.on_message = on_message
        self.on_lost = on_lost
        self.transport: Any = None  # uvloop's transports are not asyncio.Transport's kind
        self._buffer = bytearray()

    # -- asyncio.Protocol -------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None and SEND_BUFFER_BYTES > 0:
            with contextlib.suppress(OSError):  # best effort: the kernel's default stays
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._buffer.clear()
        if self.on_lost is not None:
            self.on_lost(self)

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        used = 0
        messages: list[list[bytes]] = []
        with memoryview(buffer) as view:
            end = len(view)
            while end - used >= COUNT.size:
                (count,) = COUNT.unpack_from(view, used)
                if count > MAX_FRAMES:
                    log.error("a message of %d frames: the stream is corrupt; closing it", count)
                    self.close()
                    return
                head = COUNT.size * (1 + count)
                if end - used < head:
                    break
                sizes = struct.unpack_from(f"<{count}I", view, used + COUNT.size)
                if end - used < head + sum(sizes):
                    break
                at = used + head
                frames = []
                for size in sizes:
                    frames.append(view[at : at + size].tobytes())
                    at += size
                messages.append(frames)
                used = at
        if used:
            del buffer[:used]
        for frames in messages:
            try:
                self.on_message(self, frames)
            except Exception:  # one bad message must not end the connection
                log.exception("a message could not be handled")

    # -- sending ----------------------------------------------------------------------

    def send(self, frames: Sequence[Frame]) -> bool:
        """Queue one message without waiting; False when it cannot go (no connection, or
        the peer has left `MAX_QUEUED_BYTES` unread)."""
        return self.send_all([frames])

    def send_all(self, messages: Sequence[Sequence[Frame]]) -> bool:
        """Queue several messages in one write (one system call where one message each
        would make as many), without waiting; False as `send`."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return False
        if transport.get_write_buffer_size() > MAX_QUEUED_BYTES:
            return False
        transport.writelines(framed(messages))
        return True

    def queued_bytes(self) -> int:
        """What was sent and is still in this process, not yet in the kernel's socket."""
        transport = self.transport
        return 0 if transport is None else int(transport.get_write_buffer_size())

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


async def serve(address: str, connected: Callable[[], Framed]) -> asyncio.AbstractServer:
    """Listen at `address` (a stale socket file from an earlier run is replaced); each
    connection gets the protocol `connected` makes."""
    path = Path(socket_path(address))
    path.unlink(missing_ok=True)
    loop = asyncio.get_running_loop()
    return await loop.create_unix_server(connected, str(path))


async def connect(address: str, protocol: Framed) -> Framed:
    """`protocol` connected to the engine at `address`; raises OSError while nothing
    listens there yet (the caller retries)."""
    loop = asyncio.get_running_loop()
    await loop.create_unix_connection(lambda: protocol, socket_path(address))
    return protocol
