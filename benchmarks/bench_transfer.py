"""Page transfer between two processes: NixlTransport against raw NIXL, descriptors per page.

A spawned "prefill" process holds a pool-shaped tensor ``[layers, pages, page_bytes]`` and
serves reads (it polls its notices, which progresses its agent). This process holds two agents
on an identical tensor: a raw ``nixl_agent`` and a :class:`~kvmem.transfer.NixlTransport`. For
each request size (1, 16, 256 pages: one run of adjacent pages, so one descriptor per layer)
both READ the same bytes with the same descriptors and the same notice, in lockstep (each step
runs every contender, in alternating order, ``--repeat`` steps); a read is timed from post to
"done" and release. Medians.

    python benchmarks/bench_transfer.py [--json] [--layers 24] [--page-bytes 32768]
        [--repeat 30] [--ucx-tls tcp,self]

JSON: ``ucx_tls``; ``read_us`` ``{pages: {"raw": us, "kvmem": us, "kvmem_unmerged": us}}``;
``kvmem_over_raw_nixl`` ``{pages: median over steps of raw / kvmem}`` (paired; goal >= 0.8)
and its minimum;
``descs_per_page`` ``{pattern: {"merged": x, "unmerged": x}}`` for a run of adjacent pages and
for pages scattered over the pool; ``descs_us`` ``{pages: us}`` (building one side's
descriptors); ``control_us`` (``None`` until the sender/receiver API is measured: see HOOK).
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

from kvmem.transfer import NixlTransport
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


def control_us(num_pages: int) -> float | None:
    """HOOK control_us: kvmem's control-plane cost per request (export under a lease, receive,
    confirm) for ``num_pages`` pages, in microseconds, without the bytes' transfer. To be filled
    once the sender/receiver API lands; ``None`` until then."""
    return None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON only")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--pool-pages", type=int, default=384)
    parser.add_argument("--page-bytes", type=int, default=32768,
                        help="one page of one layer (16 tokens x K,V x 8 heads x 64 x 2 B)")
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--ucx-tls", default="tcp,self")
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES),
                        help="request sizes in pages")
    args = parser.parse_args(argv)
    sizes = args.sizes
    if min(sizes) < 1 or args.pool_pages < 64 + max(max(sizes), 256):
        parser.error(f"sizes must be >= 1 and --pool-pages >= {64 + max(max(sizes), 256)}")

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

    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "ucx_tls": args.ucx_tls,
        "shape": list(shape),
        "repeat": args.repeat,
        "read_us": read_us,
        "kvmem_over_raw_nixl": ratio,
        "kvmem_over_raw_nixl_min": min(ratio.values()),
        "descs_per_page": descs,
        "descs_us": build_us,
        "control_us": {n: control_us(n) for n in sizes},
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        mib = args.layers * args.page_bytes / 2**20
        print(f"UCX_TLS={args.ucx_tls}; pool {shape}, {mib:.2f} MiB per page over all layers")
        print("pages  raw us  kvmem us  kvmem unmerged us  kvmem/raw  descs us")
        for n in sizes:
            r = read_us[n]
            print(f"{n:5d} {r['raw']:7.0f} {r['kvmem']:9.0f} {r['kvmem_unmerged']:18.0f} "
                  f"{ratio[n]:10.2f} {build_us[n]:9.1f}")
        for pattern, d in descs.items():
            print(f"descs per page, {pattern}: {d['merged']:.3f} merged, {d['unmerged']:.0f} "
                  "unmerged")
        print("control_us: not measured yet (HOOK control_us)")
    return result


if __name__ == "__main__":
    main()
