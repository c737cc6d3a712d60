"""kvmem.planning."""
