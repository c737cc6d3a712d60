"""kvmem.integrity."""
