"""kvmem.quant."""
