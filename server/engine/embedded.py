"""The engine on a thread of the frontend's process, over the same socket and messages.

For tests and a quick look on a laptop: `build_app(settings)` without an engine address
starts one, so every request still crosses `server.messages` and shared memory exactly as
between processes, with one process to start and stop. `python -m server` never uses it.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import threading
import uuid
from pathlib import Path

from server.engine.process import EngineServer
from server.engine.services import Engine
from server.metrics import Metrics
from server.settings import Settings


class EmbeddedEngine:
    """An `EngineServer` running its own event loop on a daemon thread."""

    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        folder = Path(tempfile.gettempdir())
        self.address = f"ipc://{folder}/serve-engine-{uuid.uuid4().hex[:12]}.sock"
        self.server = EngineServer(settings, self.address, metrics)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="embedded-engine", daemon=True)

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self.server.run()

    def start(self) -> None:
        self._thread.start()
        if not self.server.bound.wait(timeout=30):
            raise RuntimeError("the embedded engine did not bind its socket")

    def stop(self, timeout_s: float = 60.0) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self.server.stop.set)
        self._thread.join(timeout=timeout_s)
        Path(self.address.removeprefix("ipc://")).unlink(missing_ok=True)

    @property
    def engine(self) -> Engine | None:
        """The engine itself (tests look at its caches)."""
        return self.server.engine
