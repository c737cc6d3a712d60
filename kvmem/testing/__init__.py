"""kvmem.testing."""
