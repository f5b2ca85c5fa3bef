"""TEST-ONLY stand-in for torchvision (see tests/_stubs/README.md); not the real package."""

__version__ = "0.0.0+test-stub"
IS_TEST_STUB = True
