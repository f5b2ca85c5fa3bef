"""The engine process's spawn target, importable without torch.

A spawned process is given its target by reference (module and name), and the parent
imports that module to name it. `engine_main` lives beside torch and the models, so the
supervisor that started it imported torch too: 4 to 6 s of every start on the GPU machine
before the engine process even existed (issue 21). The supervisor names this function
instead; the engine process imports the real one itself.
"""

from __future__ import annotations

from server.settings import Settings


def run_engine(settings: Settings, address: str, role: str) -> None:
    """`server.engine.process.engine_main`, imported in the engine process only."""
    from server.engine.process import engine_main

    engine_main(settings, address, role)
