"""kvmem.allocator."""
