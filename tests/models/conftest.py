"""Fixtures for the SAM tests: Meta's reference model on the same random weights as ours
(built in tests/reference_sam.py; tests/conftest.py provides the torchvision stand-in)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from models.sam import SAM_CONFIGS, Sam, SamConfig, load_sam
from tests.reference_sam import build_reference_sam, randomize_reference, relative_error


@pytest.fixture(scope="session")
def tiny_config() -> SamConfig:
    return SAM_CONFIGS["vit_tiny"]


@pytest.fixture(scope="session")
def reference_checkpoint(
    tmp_path_factory: pytest.TempPathFactory, tiny_config: SamConfig
) -> tuple[Any, Path]:
    """Meta's tiny model with random weights, and its state dict saved as an official `.pth`."""
    model = build_reference_sam(tiny_config)
    randomize_reference(model, seed=1234)
    path = tmp_path_factory.mktemp("sam") / "sam_vit_tiny_random.pth"
    torch.save(model.state_dict(), path)
    return model, path


@pytest.fixture(scope="session")
def reference_sam(reference_checkpoint: tuple[Any, Path]) -> Any:
    return reference_checkpoint[0]


@pytest.fixture(scope="session")
def tiny_sam(reference_checkpoint: tuple[Any, Path], tiny_config: SamConfig) -> Sam:
    """Our model loaded from the reference checkpoint (read-only: do not modify)."""
    return load_sam(tiny_config, reference_checkpoint[1])


@pytest.fixture(scope="session")
def rel_err() -> Callable[[Tensor, Tensor], float]:
    return relative_error


@pytest.fixture(scope="session")
def reference_builder() -> Callable[[SamConfig], Any]:
    return build_reference_sam
