#!/usr/bin/python3
"""Where a worker's link time goes, step by step (bench/cluster_emulation.sh TRACE_S).

  link_trace.py capture IFACE SECONDS OUT
      Records the TCP headers IFACE sends and receives for SECONDS (an
      AF_PACKET socket: root, inside the host's network namespace; headers
      only, no payload) into OUT, one packet per line.
  link_trace.py report OUT --port PORT --rate-bits BITS [--idle-ms MS]
      Splits the capture into steps (both directions idle for --idle-ms or
      more: the fixed compute between two steps) and prints, per step and as
      medians, for this host's link:
        push_ms      first to last data packet it sent to PORT (its pushes;
                     packets of under 512 payload bytes are control traffic
                     and left out everywhere);
        link_ms      the same bytes at BITS: what a full link would take;
        underfill_ms push_ms - link_ms: time the uplink was not full;
        tail_ms      from the last 10 ms at >= 80 % of BITS to the push's end;
        flows_ms     when each connection to a PORT peer (a shard) sent its
                     last byte, after the push started: first, median, last;
        pull_after_ms the last byte received from PORT after the push's last;
        pull_ms, pull_link_ms  first to last data packet received from PORT
                     (the pulls), and the same bytes at BITS.
      Packets the kernel dropped before the capture read them are counted
      (PACKET_STATISTICS); a capture with drops under-counts bytes.

Standard library only (the GPU machine and fresh Debian roots have python3).
"""
import argparse
import socket
import statistics
import struct
import sys
import time

ETH_P_ALL = 3
PACKET_OUTGOING = 4
SOL_PACKET = 263
PACKET_STATISTICS = 6
# Packets with less payload are control traffic, not chunk data.
MIN_DATA_BYTES = 512


def capture(iface, seconds, out):
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(ETH_P_ALL))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 20)
    sock.bind((iface, 0))
    sock.settimeout(0.2)
    rows = []
    end = time.time() + seconds
    while time.time() < end:
        try:
            frame, addr = sock.recvfrom(128)
        except socket.timeout:
            continue
        t = time.time()
        # IPv4 over Ethernet, TCP only.
        if len(frame) < 54 or frame[12:14] != b"\x08\x00" or frame[23] != 6:
            continue
        ihl = (frame[14] & 15) * 4
        total = struct.unpack("!H", frame[16:18])[0]
        o = 14 + ihl
        if len(frame) < o + 14:
            continue
        sport, dport = struct.unpack("!HH", frame[o:o + 4])
        payload = total - ihl - (frame[o + 12] >> 4) * 4
        out_dir = 1 if addr[2] == PACKET_OUTGOING else 0
        rows.append(f"{t:.6f} {out_dir} {socket.inet_ntoa(frame[26:30])} {sport} "
                    f"{socket.inet_ntoa(frame[30:34])} {dport} {payload}")
    packets, drops = struct.unpack("II", sock.getsockopt(SOL_PACKET, PACKET_STATISTICS, 8))
    with open(out, "w") as f:
        f.write(f"# packets {packets} drops {drops}\n")
        f.write("\n".join(rows) + ("\n" if rows else ""))


def report(path, port, rate_bits, idle_ms):
    drops = 0
    pkts = []  # (t, outgoing, peer, payload) of connections to or from `port`.
    with open(path) as f:
        for line in f:
            if line.startswith("#"):
                drops = int(line.split()[4])
                continue
            t, out_dir, src, sport, dst, dport, payload = line.split()
            out_dir, payload = out_dir == "1", int(payload)
            if payload < MIN_DATA_BYTES:
                continue  # ACKs, credits, replies, HTTP/2 window updates and pings.
            if out_dir and int(dport) == port:
                pkts.append((float(t), True, f"{dst}:{sport}", payload))
            elif not out_dir and int(sport) == port:
                pkts.append((float(t), False, f"{src}:{dport}", payload))
    pkts.sort()
    # Only the connections that carry the pushes and the pulls: each moved at
    # least a fifth of the mean per connection of its direction (heartbeats
    # and other calls to the coordinator's port are left out).
    moved = {}
    for p in pkts:
        moved[(p[1], p[2])] = moved.get((p[1], p[2]), 0) + p[3]
    for out_dir in (True, False):
        flows = [b for (o, _), b in moved.items() if o == out_dir]
        if flows:
            floor = 0.2 * sum(flows) / len(flows)
            for key in [k for k, b in moved.items() if k[0] == out_dir and b < floor]:
                del moved[key]
    pkts = [p for p in pkts if (p[1], p[2]) in moved]
    steps, cur = [], []
    for p in pkts:
        if cur and p[0] - cur[-1][0] > idle_ms / 1e3:
            steps.append(cur)
            cur = []
        cur.append(p)
    if cur:
        steps.append(cur)
    # The first and last steps are cut by the capture's start and end; a
    # pause of the host inside a step (a busy CPU) cuts it in two: pieces
    # that sent under a quarter of the median step's push bytes are left out.
    steps = steps[1:-1]
    sent = [sum(p[3] for p in s if p[1]) for s in steps]
    if sent:
        floor = 0.25 * statistics.median(sent)
        steps = [s for s, b in zip(steps, sent) if b >= floor and b > 0]
    print(f"link_trace: {len(pkts)} packets with payload to or from port {port}, "
          f"{len(steps)} whole steps, {drops} dropped by the kernel before capture")
    rows = []
    for s in steps:
        push = [p for p in s if p[1]]
        pull = [p for p in s if not p[1]]
        if not push or not pull:
            continue
        start, end = push[0][0], push[-1][0]
        push_bytes = sum(p[3] for p in push)
        link_ms = push_bytes * 8 / rate_bits * 1e3
        push_ms = (end - start) * 1e3
        # 10 ms bins of the bytes sent; the tail starts after the last full one.
        bins = [0] * (int((end - start) / 0.01) + 1)
        for p in push:
            bins[int((p[0] - start) / 0.01)] += p[3]
        full = [i for i, b in enumerate(bins) if b * 8 / 0.01 >= 0.8 * rate_bits]
        tail_ms = push_ms - (full[-1] + 1) * 10 if full else push_ms
        last_by_flow = {}
        for p in push:
            last_by_flow[p[2]] = p[0]
        flows = sorted((t - start) * 1e3 for t in last_by_flow.values())
        pull_bytes = sum(p[3] for p in pull)
        rows.append({
            "push_ms": push_ms, "link_ms": link_ms, "underfill_ms": push_ms - link_ms,
            "pull_ms": (pull[-1][0] - pull[0][0]) * 1e3,
            "pull_link_ms": pull_bytes * 8 / rate_bits * 1e3,
            "tail_ms": max(0.0, tail_ms), "flow_first_ms": flows[0], "flow_median_ms":
            statistics.median(flows), "flow_last_ms": flows[-1], "flows": len(flows),
            "pull_after_ms": (pull[-1][0] - end) * 1e3,
        })
    for r in rows:
        print("link_trace: step push_ms {push_ms:.0f} link_ms {link_ms:.0f} underfill_ms "
              "{underfill_ms:.0f} tail_ms {tail_ms:.0f} flows {flows} flows_ms {flow_first_ms:.0f}/"
              "{flow_median_ms:.0f}/{flow_last_ms:.0f} pull_after_ms {pull_after_ms:.0f} pull_ms "
              "{pull_ms:.0f} pull_link_ms {pull_link_ms:.0f}".format(**r))
    if rows:
        m = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        print("link_trace: median of {n} steps: push_ms {push_ms:.0f} link_ms {link_ms:.0f} "
              "underfill_ms {underfill_ms:.0f} tail_ms {tail_ms:.0f} flows_ms {flow_first_ms:.0f}/"
              "{flow_median_ms:.0f}/{flow_last_ms:.0f} pull_after_ms {pull_after_ms:.0f} pull_ms "
              "{pull_ms:.0f} pull_link_ms {pull_link_ms:.0f}".format(n=len(rows), **m))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    c = sub.add_parser("capture")
    c.add_argument("iface")
    c.add_argument("seconds", type=float)
    c.add_argument("out")
    r = sub.add_parser("report")
    r.add_argument("path")
    r.add_argument("--port", type=int, required=True)
    r.add_argument("--rate-bits", type=float, required=True)
    r.add_argument("--idle-ms", type=float, default=30)
    args = ap.parse_args()
    if args.what == "capture":
        capture(args.iface, args.seconds, args.out)
    else:
        report(args.path, args.port, args.rate_bits, args.idle_ms)


if __name__ == "__main__":
    sys.exit(main())
