"""One /status for S syncer shards: shard 0's page with every shard's fragments, counters and health.

Shard 0 serves it (``wan-diloco syncer --shard 0 --shard-status URL,...``,
which ``launch`` passes): at each request it asks the other shards' /status
with the run's token, at most ``timeout_s`` each, and folds their answers
into its own. A shard that does not answer is shown as unreachable with the
reason; its fragments keep the versions it last reported, and the rest of the
page is whole.
"""
from __future__ import annotations

import asyncio
import ssl

import aiohttp

from wan_diloco.transport.config import TlsConfig

# Counters each shard keeps for its own fragments: the run's are their sums.
SUMMED = ("late_dropped", "late_carried", "stale_dropped", "duplicate_dropped", "stale_epoch", "quarantines",
          "refused_rounds", "bytes_in", "bytes_out", "probe_bytes", "rejected", "resyncs_served")


def aggregate(own: dict, others: dict[int, dict | str], last: dict[int, dict] | None = None) -> dict:
    """Shard 0's status ``own`` with the other shards' (their /status, or why there is none).
    ``last``: each shard's latest good answer, used for its fragments while it is unreachable."""
    last = last if last is not None else {}
    pages = {0: own}
    rows = [_row(0, own, None)]
    for s in sorted(others):
        got = others[s]
        if isinstance(got, dict):
            last[s] = got
            pages[s] = got
            rows.append(_row(s, got, None))
        else:
            rows.append(_row(s, last.get(s, {}), got))
            if s in last:
                pages[s] = last[s]
    out = dict(own)
    versions, syncs = list(own["versions"]), list(own.get("fragment_syncs", []))
    for s, page in pages.items():
        for p in page.get("owned", ()):
            versions[p] = page["versions"][p]
            if p < len(syncs) and p < len(page.get("fragment_syncs", ())):
                syncs[p] = page["fragment_syncs"][p]
    out["versions"], out["fragment_syncs"] = versions, syncs
    for key in SUMMED:
        out[key] = sum(page.get(key, 0) or 0 for page in pages.values())
    for key in ("quorum_sizes", "grace_s"):
        out[key] = [x for page in pages.values() for x in page.get(key, [])][-100:]
    out["history"] = sorted((h for page in pages.values() for h in page.get("history", [])),
                            key=lambda h: h["closed_s"])[-100:]
    out["final_done"] = all(page.get("final_done", False) for page in pages.values()) and len(pages) == len(rows)
    out["shards"] = rows
    return out


def _row(shard: int, page: dict, error: str | None) -> dict:
    return {"shard": shard, "reachable": error is None, "error": error, "owned": page.get("owned", []),
            "epoch": page.get("epoch"), "uptime_s": page.get("uptime_s"), "bytes_in": page.get("bytes_in"),
            "bytes_out": page.get("bytes_out"), "final_done": page.get("final_done")}


class ShardStatus:
    """The other shards' /status pages, fetched concurrently for shard 0's /status."""

    def __init__(self, urls: list[str], token: str, tls: TlsConfig | None = None, timeout_s: float = 2.0):
        self.urls, self.token, self.timeout_s = urls, token, timeout_s
        self.ssl: ssl.SSLContext | bool = False
        if tls is not None and any(u.startswith("https://") for u in urls):
            self.ssl = ssl.create_default_context(cafile=tls.ca_file or None)
            if tls.mutual:
                self.ssl.load_cert_chain(tls.cert_file, tls.key_file)
        self.last: dict[int, dict] = {}

    async def fetch(self) -> dict[int, dict | str]:
        """Shard s (1..S-1) -> its /status, or a line saying why there is none."""
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        headers = {"Authorization": f"Bearer {self.token}"}
        async with aiohttp.ClientSession(timeout=timeout, headers=headers) as session:
            got = await asyncio.gather(*(self._one(session, u) for u in self.urls))
        return {s + 1: g for s, g in enumerate(got)}

    async def _one(self, session: aiohttp.ClientSession, url: str) -> dict | str:
        try:
            async with session.get(f"{url.rstrip('/')}/status", ssl=self.ssl) as r:
                if r.status != 200:
                    return f"HTTP {r.status} from {url}"
                return await r.json()
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            return f"{type(e).__name__} from {url}: {e}"[:300]

    async def status(self, own: dict) -> dict:
        return aggregate(own, await self.fetch(), self.last)
