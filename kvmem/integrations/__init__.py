"""kvmem.integrations."""
