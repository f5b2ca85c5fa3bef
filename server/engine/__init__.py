"""The engine: models, batchers, caches and the GPU worker, in a process of its own."""
