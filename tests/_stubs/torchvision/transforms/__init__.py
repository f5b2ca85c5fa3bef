"""TEST-ONLY stand-in for torchvision.transforms (see tests/_stubs/README.md)."""
