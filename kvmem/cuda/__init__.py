"""kvmem.cuda."""
