"""What the kernel says about a sender's TCP connections while a benchmark runs (``ss -tin``): the
congestion window, retransmitted bytes, and how long each connection was limited by the receiver's
window or its own send buffer. It tells a link that TCP has not filled yet from a sender that had
nothing to send, for gRPC's connections too (they are not ours to ask)."""
from __future__ import annotations

import contextlib
import threading

FIELDS = {"mss": int, "cwnd": int, "ssthresh": int, "bytes_sent": int, "bytes_retrans": int, "busy": "ms",
          "rwnd_limited": "ms", "sndbuf_limited": "ms", "minrtt": float}


def parse_ss(text: str) -> list[dict]:
    """``ss -tinH`` output: one dict per connection, its addresses and the FIELDS it reported (times in ms)."""
    conns: list[dict] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        if not line[0].isspace():  # "ESTAB 0 0 local:port peer:port"
            local, peer = line.split()[-2:] if len(line.split()) >= 5 else ("?", "?")
            conns.append({"local": local, "peer": peer})
            continue
        if not conns:
            continue
        for token in line.split():
            key, _, value = token.partition(":")
            if key == "retrans" and "/" in value:  # "now/total" segments retransmitted
                conns[-1]["retrans_segs"] = int(value.split("/")[1])
                continue
            kind = FIELDS.get(key)
            if kind is None or not value:
                continue
            try:
                conns[-1][key] = float(value.split("ms")[0]) if kind == "ms" else kind(value)
            except ValueError:
                pass
    return conns


@contextlib.contextmanager
def sampled(emu, region: str, peer_host: str, out: list, every_s: float = 0.5):
    """While the block runs, sample ``region``'s connections to ``peer_host`` every ``every_s`` and as it
    ends; ``out`` gets the last sample of each connection that carried bytes (its counters only grow)."""
    stop, last = threading.Event(), {}

    def sample():
        res = emu.exec(region, ["ss", "-tinH", "dst", peer_host], check=False, timeout=10)
        for c in parse_ss(res.stdout):
            if c.get("bytes_sent", 0) > 0:
                last[c["local"], c["peer"]] = c

    def loop():
        while not stop.wait(every_s):
            sample()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield
        sample()  # the counters as the block ends, whatever the sampling thread last saw
    finally:
        stop.set()
        thread.join(15)
        out.extend(sorted(last.values(), key=lambda c: -c.get("bytes_sent", 0)))
