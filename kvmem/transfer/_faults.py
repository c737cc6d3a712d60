"""TransferFaults: switches that make a Sender or a Receiver skip one of its own protections."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TransferFaults"]


@dataclass
class TransferFaults:
    """Switches that make the transfer room skip one of its own protections, for fault injection
    only (``kvmem.testing.faults``, ``kvmem fuzz --engine disagg``): a fuzzer proves its oracles
    catch the bug each one re-creates. All True in production; never switch them off elsewhere.
    A :class:`~kvmem.transfer.Sender` and a :class:`~kvmem.transfer.Receiver` each read their
    own (``sender.faults``, ``receiver.faults``; one object may serve both).

    Sender
        lease_pages: ``export`` leases the pages and a confirm checks their lifetimes (False: it
            sends page ids with no lifetime behind them and answers every confirm "ok")
        end_lease_once: a confirm of a transfer answered already is answered "stale" (False:
            it ends the transfer's lease again: a duplicated confirm)
        expire_leases: ``poll`` ends the leases whose term has passed (False: a lease whose
            confirm was lost is held forever)

    Receiver
        hold_until_final: an aborted load's destination pages stay leased until its read is
            final (False: they go back at the abort, while bytes may still land in them)
        wait_for_answer: a load is committed after the sender's answer (False: on the digests
            alone, even when the sender's lease ended before the read completed)
        fail_failed_reads: a read that failed fails its load (False: it is taken as done and
            committed, as if its bytes had moved)
        commit_checked_only: only a load that passed every check is committed (False: a failed
            load's pages are committed into the prefix cache anyway and its request is released
            for the engine to admit again: its recompute reuses them)
    """

    lease_pages: bool = True
    end_lease_once: bool = True
    expire_leases: bool = True
    hold_until_final: bool = True
    wait_for_answer: bool = True
    fail_failed_reads: bool = True
    commit_checked_only: bool = True
