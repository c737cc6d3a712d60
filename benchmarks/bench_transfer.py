"""Page transfer: NixlTransport against raw NIXL between two processes, descriptors per page,
and kvmem's control-plane cost per request.

Reads: a spawned "prefill" process holds a pool-shaped tensor ``[layers, pages, page_bytes]``
and serves reads (it polls its notices, which progresses its agent). This process holds two
agents on an identical tensor: a raw ``nixl_agent`` and a :class:`~kvmem.transfer.NixlTransport`.
For each request size (1, 16, 256 pages: one run of adjacent pages, so one descriptor per layer)
both READ the same bytes with the same descriptors and the same notice, in lockstep (each step
runs every contender, in alternating order, ``--repeat`` steps); a read is timed from post to
"done" and release. Medians.

Control: a Sender and a Receiver with real managers and bf16 pools (``--layers`` x
``--kv-heads`` x ``--head-dim``, 16-token pages) in one process over the in-process transport,
reads held so that their bytes (copied by memmove) move outside the timed calls. Per request:
``Sender.export``, ``Receiver.receive``, ``Receiver.poll`` (read final: digests checked),
``Sender.poll`` (the confirm answered), ``Receiver.poll`` (reserve + commit: "loaded"), each
timed; ``--control-repeat`` steps of every size in turn. Medians.

    python benchmarks/bench_transfer.py [--json] [--layers 24] [--page-bytes 32768]
        [--repeat 30] [--ucx-tls tcp,self] [--kv-heads 8] [--head-dim 128]
        [--control-repeat 15] [--skip-reads]

JSON: ``ucx_tls``; ``read_us`` ``{pages: {"raw": us, "kvmem": us, "kvmem_unmerged": us}}``;
``kvmem_over_raw_nixl`` ``{pages: median over steps of raw / kvmem}`` (paired; goal >= 0.8)
and its minimum;
``descs_per_page`` ``{pattern: {"merged": x, "unmerged": x}}`` for a run of adjacent pages and
for pages scattered over the pool; ``descs_us`` ``{pages: us}`` (building one side's
descriptors); ``control_us`` ``{pages: us}`` (median over steps of the five calls' sum),
``control_parts_us`` ``{pages: {call: us, "memmove": us}}``, ``control_pool``;
``digest_us`` ``{pages: {"gather_then_hash": us, "hash_in_place": us}}`` (one side's digests).
Loopback on one host is not a network: these are not product bandwidth figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch

from kvmem import KVCacheManager, PagePool, PoolSpec
from kvmem.transfer import (
    CacheIdentity,
    InProcessHub,
    InProcessTransport,
    NixlTransport,
    Receiver,
    Sender,
    gather_pages,
    page_digests,
)
from kvmem.transfer._bundle import pool_page_digests
from kvmem.transfer._descs import Region, page_descs, tensor_descs
from kvmem.transfer._peer import Peer

SIZES = (1, 16, 256)


def serve(conn: Connection, shape: tuple[int, int, int], ucx_tls: str) -> None:
    """The prefill process: register the pool, answer "peer" commands, serve reads until "stop"."""
    if len(os.sched_getaffinity(0)) > 1:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    transport = NixlTransport("prefill", ucx_tls=ucx_tls)
    pages = torch.full(shape, 7, dtype=torch.uint8)
    transport.register(tensor_descs(pages))
    conn.send((transport.metadata(), pages.data_ptr()))
    while True:
        while not conn.poll(0):
            transport.notices()
        cmd, *args = conn.recv()
        if cmd == "stop":
            transport.close()
            return
        conn.send(transport.add_peer(args[0]))


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e6


def raw_read(agent: Any, peer: str, local: np.ndarray, remote: np.ndarray) -> None:
    """What a caller of NIXL's Python API writes for one read: post, poll, release."""
    xfer = agent.initialize_xfer("READ", agent.get_xfer_descs(local, "DRAM"),
                                 agent.get_xfer_descs(remote, "DRAM"), peer, b"r")
    state = agent.transfer(xfer)
    while state == "PROC":
        state = agent.check_xfer_state(xfer)
    if state != "DONE":
        raise RuntimeError(f"raw NIXL read ended {state}")
    agent.release_xfer_handle(xfer)


def kvmem_read(transport: NixlTransport, peer: str, local: np.ndarray, remote: np.ndarray
               ) -> None:
    handle = transport.read(peer, local, remote, b"r")
    while (state := transport.state(handle)) == "pending":
        pass
    if state != "done":
        raise RuntimeError(f"kvmem read ended {state}")
    transport.release(handle)


def descs_per_page(region: Region, rng: np.random.Generator) -> dict[str, dict[str, float]]:
    num_pages = region.num_pages
    patterns = {
        "run": np.arange(64, 64 + 256),
        "scattered": np.sort(rng.choice(num_pages, 256, replace=False)),
    }
    return {
        name: {
            "merged": len(page_descs(region, ids)) / len(ids),
            "unmerged": len(page_descs(region, ids, merge=False)) / len(ids),
        }
        for name, ids in patterns.items()
    }


PARTS = ("export", "receive", "poll_read", "sender_poll", "poll_answer")


class ControlSides:
    """A sender and a receiver (real managers, bf16 pools ``[layers, pages, 16 tokens, K/V,
    kv_heads, head_dim]``) over the in-process transport, reads held so that their bytes move
    (``ctypes.memmove``) outside the timed calls."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, max_pages: int) -> None:
        hub = InProcessHub()
        sides = []
        for name, num_pages in (("prefill", max_pages + 16), ("decode", 2 * max_pages + 16)):
            spec = PoolSpec(num_layers=layers, num_pages=num_pages, page_size=16,
                            num_kv_heads=kv_heads, head_dim=head_dim, dtype="bf16",
                            device="cpu")
            pool = PagePool(spec)
            manager = KVCacheManager(num_pages, page_size=16, max_seqs=4,
                                     max_pages_per_seq=max_pages + 1, pool=pool)
            sides.append((manager, pool, InProcessTransport(name, hub),
                          CacheIdentity.of(spec, "bench", "sha256:0")))
        (self.m_p, self.pool_p, t_p, id_p), (self.m_d, pool_d, t_d, id_d) = sides
        t_p.add_peer(t_d.metadata())
        t_d.add_peer(t_p.metadata())
        t_d.hold_reads = True
        self.t_d = t_d
        self.pool_p.data.normal_(generator=torch.Generator().manual_seed(0))
        self.sender = Sender(self.m_p, self.pool_p, t_p, id_p)
        self.receiver = Receiver(self.m_d, pool_d, t_d, id_d)
        self.page_nbytes = self.pool_p.data[0, 0].nbytes * layers
        self.rng = np.random.default_rng(0)
        self.next = 0

    def once(self, num_pages: int) -> dict[str, float]:
        """One request of ``num_pages`` full pages, prefilled (not timed), sent and loaded:
        microseconds per kvmem call, and ``memmove`` (the bytes' copy, not kvmem's)."""
        rid, self.next = self.next, self.next + 1
        tokens = self.rng.integers(0, 50_000, num_pages * 16)  # fresh: no prefix hit
        self.m_p.admit(rid, tokens)
        self.m_p.reserve([rid], tokens.size)
        self.m_p.commit(rid, tokens)
        us: dict[str, float] = {}
        out: list[Any] = []

        def part(name: str, fn: Callable[[], Any]) -> None:
            t0 = time.perf_counter()
            out.append(fn())
            us[name] = (time.perf_counter() - t0) * 1e6

        part("export", lambda: self.sender.export(rid, 0.0))
        part("receive", lambda: self.receiver.receive(out[-1], 0.0))
        (handle,) = self.t_d.pending
        us["memmove"] = timed(lambda: self.t_d.complete(handle))
        part("poll_read", lambda: self.receiver.poll(0.0))  # digests checked, answer awaited
        part("sender_poll", lambda: self.sender.poll(0.0))  # the confirm answered
        part("poll_answer", lambda: self.receiver.poll(0.0))  # reserve + commit: loaded
        if out[2] != [] or len(out[3]) != 1 or [r.status for r in out[4]] != ["loaded"]:
            raise RuntimeError(f"request {rid} did not load: {out[2:]}")
        self.m_p.release(rid)
        self.m_d.release(rid)
        return us

    def digest_paths(self, num_pages: int) -> dict[str, float]:
        """One side's page digests two ways, microseconds: gathered to the host first
        (``page_digests(gather_pages(...))``, a bundle's path) and hashed where they lie
        (``pool_page_digests``, the sender's and receiver's)."""
        pages = np.arange(8, 8 + num_pages)
        tokens = np.zeros((num_pages, 16), dtype=np.int64)
        return {
            "gather_then_hash": timed(lambda: page_digests(gather_pages(self.pool_p, pages),
                                                           tokens, None)),
            "hash_in_place": timed(lambda: pool_page_digests(self.pool_p, pages, tokens, None)),
        }


def control_us(sizes: list[int], layers: int, kv_heads: int, head_dim: int, repeat: int
               ) -> dict[str, Any]:
    """kvmem's control-plane cost per request (export under a lease, receive, the receiver's
    polls up to "loaded", the sender's poll answering), in microseconds: medians over
    ``repeat`` steps, each step every size in turn (one process, in-process transport)."""
    sides = ControlSides(layers, kv_heads, head_dim, max(sizes))
    times: dict[int, list[dict[str, float]]] = {n: [] for n in sizes}
    digest: dict[int, list[dict[str, float]]] = {n: [] for n in sizes}
    for step in range(repeat + 1):  # one warm-up round
        for n in sizes:
            us = sides.once(n)
            paths = sides.digest_paths(n)
            if step:
                times[n].append(us)
                digest[n].append(paths)
    return {
        "pool": {"layers": layers, "kv_heads": kv_heads, "head_dim": head_dim,
                 "page_size": 16, "dtype": "bf16", "page_mib": sides.page_nbytes / 2**20},
        "control_us": {n: float(np.median([sum(t[k] for k in PARTS) for t in ts]))
                       for n, ts in times.items()},
        "parts_us": {n: {k: float(np.median([t[k] for t in ts])) for k in (*PARTS, "memmove")}
                     for n, ts in times.items()},
        "digest_us": {n: {k: float(np.median([t[k] for t in ts])) for k in ts[0]}
                      for n, ts in digest.items()},
    }


def nixl_reads(args: argparse.Namespace) -> dict[str, Any]:
    """NixlTransport against raw NIXL (see the module docstring)."""
    sizes = args.sizes
    shape = (args.layers, args.pool_pages, args.page_bytes)
    cpus = sorted(os.sched_getaffinity(0))
    peer = Peer(serve, shape, args.ucx_tls)
    if len(cpus) > 1:
        os.sched_setaffinity(0, set(cpus[1:]))  # the peer spins on the first core, we on the rest
    from nixl._api import nixl_agent, nixl_agent_config

    transport = NixlTransport("kvmem", ucx_tls=args.ucx_tls)
    raw = nixl_agent("raw", nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    local = torch.zeros(shape, dtype=torch.uint8)
    region = Region.of(local)
    whole = tensor_descs(local)
    transport.register(whole)
    raw.register_memory([(int(a), int(n), int(d), "") for a, n, d in whole], "DRAM")
    metadata, remote_base = peer.recv()
    name = transport.add_peer(metadata)
    raw_name = raw.add_remote_agent(metadata[4:]).decode()
    peer.send(("peer", transport.metadata()))
    peer.recv()
    peer.send(("peer", b"DRAM" + bytes(raw.get_agent_metadata())))
    peer.recv()

    def remote_of(descs: np.ndarray) -> np.ndarray:
        out = descs.copy()
        out[:, 0] += remote_base - local.data_ptr()  # same shape on both sides
        return out

    read_us: dict[int, dict[str, float]] = {}
    ratio: dict[int, float] = {}
    build_us: dict[int, float] = {}
    for n in sizes:
        ids = np.arange(64, 64 + n)
        merged, unmerged = page_descs(region, ids), page_descs(region, ids, merge=False)
        pairs = {"raw": (merged, remote_of(merged)), "kvmem": (merged, remote_of(merged)),
                 "kvmem_unmerged": (unmerged, remote_of(unmerged))}
        runs: dict[str, Callable[[], object]] = {
            "raw": lambda p=pairs["raw"]: raw_read(raw, raw_name, *p),
            "kvmem": lambda p=pairs["kvmem"]: kvmem_read(transport, name, *p),
            "kvmem_unmerged": lambda p=pairs["kvmem_unmerged"]: kvmem_read(transport, name, *p),
        }
        times: dict[str, list[float]] = {k: [] for k in runs}
        for step in range(args.repeat + 2):  # two warm-up rounds
            order = list(runs.items())
            for key, fn in order if step % 2 else reversed(order):  # cancel order effects
                local[:, 64:64 + n].zero_()
                us = timed(fn)
                if step >= 2:
                    times[key].append(us)
            if step == 2 and not bool((local[:, ids] == 7).all()):
                raise RuntimeError("the bytes read are not the peer's")
        read_us[n] = {k: float(np.median(v)) for k, v in times.items()}
        ratio[n] = float(np.median(np.divide(times["raw"], times["kvmem"])))  # paired
        build_us[n] = float(np.median([timed(lambda i=ids: page_descs(region, i))
                                       for _ in range(200)]))
    descs = descs_per_page(region, np.random.default_rng(0))
    peer.send(("stop",))
    peer.close()
    transport.close()

    return {
        "ucx_tls": args.ucx_tls,
        "shape": list(shape),
        "read_us": read_us,
        "kvmem_over_raw_nixl": ratio,
        "kvmem_over_raw_nixl_min": min(ratio.values()),
        "descs_per_page": descs,
        "descs_us": build_us,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON only")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--pool-pages", type=int, default=384)
    parser.add_argument("--page-bytes", type=int, default=32768,
                        help="reads: one page of one layer (16 tokens x K,V x 8 heads x 64 x 2 B)")
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--ucx-tls", default="tcp,self")
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES),
                        help="request sizes in pages")
    parser.add_argument("--kv-heads", type=int, default=8, help="control: the pool's KV heads")
    parser.add_argument("--head-dim", type=int, default=128, help="control: the pool's head dim")
    parser.add_argument("--control-repeat", type=int, default=15)
    parser.add_argument("--skip-reads", action="store_true",
                        help="measure control_us only (no NIXL)")
    args = parser.parse_args(argv)
    sizes = args.sizes
    if min(sizes) < 1 or args.pool_pages < 64 + max(max(sizes), 256):
        parser.error(f"sizes must be >= 1 and --pool-pages >= {64 + max(max(sizes), 256)}")

    result: dict[str, Any] = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "repeat": args.repeat,
        "sizes": sizes,
    }
    if not args.skip_reads:
        result.update(nixl_reads(args))
    control = control_us(sizes, args.layers, args.kv_heads, args.head_dim, args.control_repeat)
    result.update({"control_transport": "inprocess (one process, bytes copied by memmove)",
                   "control_repeat": args.control_repeat, "control_pool": control["pool"],
                   "control_us": control["control_us"],
                   "control_parts_us": control["parts_us"], "digest_us": control["digest_us"]})
    if args.json:
        print(json.dumps(result, indent=2))
        return result
    if not args.skip_reads:
        mib = args.layers * args.page_bytes / 2**20
        read_us, ratio, build_us = (result[k] for k in ("read_us", "kvmem_over_raw_nixl",
                                                         "descs_us"))
        print(f"UCX_TLS={args.ucx_tls}; pool {result['shape']}, {mib:.2f} MiB per page over "
              "all layers")
        print("pages  raw us  kvmem us  kvmem unmerged us  kvmem/raw  descs us")
        for n in sizes:
            r = read_us[n]
            print(f"{n:5d} {r['raw']:7.0f} {r['kvmem']:9.0f} {r['kvmem_unmerged']:18.0f} "
                  f"{ratio[n]:10.2f} {build_us[n]:9.1f}")
        for pattern, d in result["descs_per_page"].items():
            print(f"descs per page, {pattern}: {d['merged']:.3f} merged, {d['unmerged']:.0f} "
                  "unmerged")
    pool = control["pool"]
    print(f"control_us (in-process transport; bf16 pool {pool['layers']} layers x "
          f"{pool['kv_heads']} KV heads x {pool['head_dim']}, {pool['page_mib']:.2f} MiB per page)")
    print("pages " + " ".join(f"{k:>11}" for k in (*PARTS, "total", "memmove")))
    for n in sizes:
        p = control["parts_us"][n]
        print(f"{n:5d} " + " ".join(f"{p[k]:11.0f}" for k in PARTS)
              + f" {control['control_us'][n]:11.0f} {p['memmove']:11.0f}")
    print("digests of one side: pages  gathered then hashed us  hashed in place us")
    for n in sizes:
        d = control["digest_us"][n]
        print(f"{n:5d} {d['gather_then_hash']:12.0f} {d['hash_in_place']:12.0f}")
    return result


if __name__ == "__main__":
    main()
