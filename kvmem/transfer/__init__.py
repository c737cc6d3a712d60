"""Pages that move: transports (see ``_transport.py`` for the contract)."""

from __future__ import annotations

from kvmem.transfer._nixl import NixlTransport

__all__ = ["NixlTransport"]
