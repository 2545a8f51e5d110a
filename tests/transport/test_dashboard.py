"""The dashboard at / : a static, self-contained page, and what a real headless Chromium makes of it.

Run as a script to refresh the screenshot in the docs:
``python tests/transport/test_dashboard.py docs/dashboard.png``.
"""
from __future__ import annotations

import asyncio
import base64
import hashlib
import math
import os
import re
import signal
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from wan_diloco import spec as rt
from wan_diloco.clock import VectorClock
from wan_diloco.core import Metadata
from wan_diloco.runtime import serde
from wan_diloco.runtime.syncer import LossCurve, SyncerService
from wan_diloco.transport import StatusServer, TransportMetrics, run
from wan_diloco.transport import status as status_module

from tests.conftest import micro_toml

CHROMIUM = "/usr/bin/chromium"
TOKEN = "dashboard-token-0123456789"
WIDTH, HEIGHT = 1280, 900
# Matplotlib's first colours, as the page's palette gives them to learners 0, 1, 2.
LEARNER_RGB = {0: (0x1F, 0x77, 0xB4), 1: (0xD6, 0x27, 0x28), 2: (0x2C, 0xA0, 0x2C)}


def arun(coro, timeout_s: float = 120.0):
    return run(asyncio.wait_for(coro, timeout_s))


# ---- a fake syncer: realistic numbers that change with every /status it serves ---------------

class FakeRun:
    """3 learners in 2 regions, losses falling and versions rising from one call to the next.

    Shaped like ``SyncerService.status()``; ``served`` keeps what each call returned, so a test
    can tell which call the page is showing.
    """

    REGIONS = {0: "us-east", 1: "us-east", 2: "eu-west"}
    FRAGMENTS = 4

    def __init__(self) -> None:
        self.served: list[dict] = []

    def __call__(self) -> dict:
        status = self.status(len(self.served))
        self.served.append(status)
        return status

    @staticmethod
    def loss(m: int, step: int) -> float:
        # Rounded as the page prints it (4 decimals), so the test compares exact strings.
        return round(2.35 + 0.3 * m + 8.5 * math.exp(-step / 420) + 0.04 * math.sin(step / 9 + m), 4)

    @staticmethod
    def step(m: int, n: int) -> int:
        return (1210 + 17 * n) if m == 2 else (1480 - 15 * m + 25 * n)  # eu-west's learner is slower

    def status(self, n: int) -> dict:
        uptime = 540.0 + 2.0 * n
        versions = [100 + 7 * n - p for p in range(self.FRAGMENTS)]
        return {
            "uptime_s": uptime, "run_id": "run-3f9a1c", "epoch": 1, "global_step": self.step(0, n),
            "regions": ["us-east", "eu-west"], "alive": [0, 1, 2], "quorum": 2, "final_done": False,
            "learners": {str(m): self.learner(m, n) for m in self.REGIONS},
            "versions": versions, "fragment_syncs": [v - 1 for v in versions],
            "fragment_bytes": [13_214_720, 12_582_912, 12_582_912, 14_680_064],
            "quorum_sizes": [3, 3, 2, 2, 3, 3, 3, 3][-8:], "grace_s": [0.4, 0.6, 0.5],
            "mean_quorum": 2.81, "grace_window_s": 1.25, "mean_grace_s": 0.52,
            "late_dropped": 1, "late_carried": 4, "stale_dropped": 0, "rejected": 0,
            "history": self.merges(n, uptime),
            "events": [
                {"at_s": 0.8, "kind": "joined", "learner": 0, "what": "learner 0 joined (us-east)"},
                {"at_s": 1.1, "kind": "joined", "learner": 1, "what": "learner 1 joined (us-east)"},
                {"at_s": 2.4, "kind": "joined", "learner": 2, "what": "learner 2 joined (eu-west)"},
                {"at_s": 402.5, "kind": "lost", "learner": 2, "what": "learner 2 lost"},
                {"at_s": 441.0, "kind": "rejoined", "learner": 2, "what": "learner 2 rejoined (eu-west)"},
            ],
            "links": {
                "learner-0": {"rtt_ms": 0.8, "rate_gbit_s": round(9.41 - 0.01 * n, 2), "age_s": 3.2},
                "learner-1": {"rtt_ms": 1.1, "rate_gbit_s": 8.97, "age_s": 5.0},
                "learner-2": {"rtt_ms": 83.4, "rate_gbit_s": 1.62, "age_s": 7.9},
            },
            "loss_history": {str(m): self.curve(m, n) for m in self.REGIONS},
            # Two syncer shards, the second one not answering shard 0 (runtime.shard_status).
            "shard": 0, "owned": [0, 3],
            "shards": [{"shard": 0, "reachable": True, "error": None, "owned": [0, 3]},
                       {"shard": 1, "reachable": False, "error": "ClientConnectorError: refused", "owned": [1, 2]}],
        }

    def learner(self, m: int, n: int) -> dict:
        step = self.step(m, n)
        return {"region": self.REGIONS[m], "alive": True, "step": step, "loss": self.loss(m, step),
                "tokens_per_s": 31_744.0 if m == 2 else 48_128.0 + 512 * m, "step_s": 0.34 if m < 2 else 0.5,
                "sync_s": 0.2, "last_seen_s_ago": 0.3, "streams": 1}

    def curve(self, m: int, n: int) -> list:
        steps = list(range(0, self.step(m, n), 12)) + [self.step(m, n)]
        return [[s, self.loss(m, s), round(s * 0.35, 3)] for s in steps]

    def merges(self, n: int, uptime: float) -> list:
        return [{"closed_s": round(uptime - 7.5 * (8 - k), 3), "fragment": k % self.FRAGMENTS,
                 "due_step": 1400 + 8 * (k + n), "contributors": [0, 1] if k == 3 else [0, 1, 2]}
                for k in range(8)]


# ---- plain HTTP -------------------------------------------------------------------------------

def csp_hash(block: str) -> str:
    return "'sha256-%s'" % base64.b64encode(hashlib.sha256(block.encode()).digest()).decode()


def test_root_serves_a_self_contained_page_without_the_token_and_status_stays_protected():
    async def main():
        async with StatusServer(FakeRun(), TransportMetrics(), token=TOKEN) as page, \
                aiohttp.ClientSession() as http:
            async with http.get(page.url + "/") as r:
                assert r.status == 200
                assert r.headers["Content-Type"] == "text/html; charset=utf-8"
                csp, html = r.headers["Content-Security-Policy"], await r.text()
            async with http.get(page.url + "/status") as r:
                assert r.status == 401
            return csp, html

    csp, html = arun(main())
    assert TOKEN not in html
    lowered = html.lower()
    for external in ("http://", "https://", "src=", "href=", "@import", "url(", "<link", "<iframe"):
        assert external not in lowered, f"the dashboard refers to something outside itself: {external!r}"
    assert 'fetch("status"' in html  # relative: the same origin (and scheme) the page came from
    # The CSP lets exactly the page's own inline style and script run, and nothing load from elsewhere.
    (script,) = re.findall(r"<script>(.*?)</script>", html, re.S)
    (style,) = re.findall(r"<style>(.*?)</style>", html, re.S)
    assert f"script-src {csp_hash(script)};" in csp and f"style-src {csp_hash(style)};" in csp
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp and "unsafe" not in csp


def test_a_missing_page_file_is_a_clear_500_and_status_still_works(monkeypatch):
    def missing():
        raise FileNotFoundError(2, "No such file or directory", "dashboard.html")
    monkeypatch.setattr(status_module, "dashboard_page", missing)

    async def main():
        async with StatusServer(FakeRun(), TransportMetrics(), token=TOKEN) as page, \
                aiohttp.ClientSession(headers=page.auth_headers) as http:
            async with http.get(page.url + "/") as r:
                assert r.status == 500 and "dashboard page (dashboard.html) is missing" in await r.text()
            async with http.get(page.url + "/status") as r:
                assert r.status == 200
    arun(main())


# ---- what the syncer adds to /status for the page -------------------------------------------

SYNCER_TOML = micro_toml(run={"learners": 2, "batch_size": 16, "token": TOKEN})  # 16: the tokens posted below


def test_syncer_status_gives_loss_tokens_history_and_liveness_events(tmp_path):
    (tmp_path / "run.toml").write_text(SYNCER_TOML)
    service = SyncerService(rt.load(tmp_path / "run.toml"), TransportMetrics())
    clock = [service.started_s]
    service.now = lambda: clock[0]

    def md(m, step, tokens, loss):
        return serde.to_frame(Metadata(learner=m, step=step, c_steps=(0, 0), c_tokens=(0, 0),
                                       clock=VectorClock({f"learner-{m}": step}), loss=loss, tokens=tokens))

    async def main():
        await service.on_metadata(md(0, 1, 0, 9.5))
        await service.on_metadata(md(1, 1, 0, 9.75))
        clock[0] += 2
        await service.on_metadata(md(0, 5, 4000, 7.25))
        clock[0] += 25  # past liveness_timeout_s: learner 1 is lost
        await service.on_metadata(md(0, 9, 9000, 6.0))
        service.tick()
        await service.on_metadata(md(1, 9, 2000, 6.5))  # and back
        return service.status()

    st = run(asyncio.wait_for(main(), 30))
    assert st["learners"]["0"]["loss"] == 6.0 and st["learners"]["0"]["tokens_per_s"] == 200.0  # 5000 tokens in 25 s
    assert st["learners"]["1"]["loss"] == 6.5
    assert [p[:2] for p in st["loss_history"]["0"]] == [[1, 9.5], [5, 7.25], [9, 6.0]]
    assert st["loss_history"]["0"][-1][2] == 27.0  # seconds since the syncer started
    # A standalone syncer's start barrier needs one learner: met when learner 0 joined.
    assert [(e["kind"], e["learner"]) for e in st["events"]] == [
        ("joined", 0), ("started", None), ("joined", 1), ("lost", 1), ("rejoined", 1)]
    assert st["events"][3]["at_s"] == 27.0


def test_loss_curves_stay_bounded_evenly_spread_and_end_at_the_latest_reading():
    curve = LossCurve(cap=256)
    for step in range(10_000):
        curve.add([step, 10.0 - step / 1000, 0.0])
        assert len(curve.points()) <= 257 and curve.points()[-1][0] == step
    steps = [p[0] for p in curve.points()]
    assert len(steps) > 128 and steps[0] == 0 and steps == sorted(steps)
    gaps = {b - a for a, b in zip(steps[:-2], steps[1:-1])}  # all but the latest reading
    assert gaps == {64}, gaps  # evenly spread: no hole where the early run was


# ---- a real browser ---------------------------------------------------------------------------

# JAX (imported above) warns on every fork; asyncio's subprocess execs Chromium straight after it.
FORK_WARNING = pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")


@pytest.fixture
def chromium():
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"{CHROMIUM} not found: install Debian's chromium (apt-get install chromium) to run the "
                    "dashboard in a real headless browser")
    return CHROMIUM


def _ours(profile: Path) -> list[int]:
    """Processes whose command line names our private profile directory: only ones we started."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if str(profile).encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                pass  # gone meanwhile
    return pids


def _kill_ours(proc, profile: Path) -> None:
    # Chromium forks a zygote, renderers and helpers: end its whole process group, then any
    # helper that left the group but still runs from our profile.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for pid in _ours(profile):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


async def browse(browser: str, url: str, workdir: Path, budget_ms: int, timeout_s: float = 90) -> tuple[str, Path]:
    """Open ``url`` in headless Chromium for ``budget_ms`` of virtual time: the DOM after the
    page's scripts ran, and a screenshot. Every process it started is gone when this returns."""
    profile, shot = workdir / "chromium-profile", workdir / "shot.png"
    args = [browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--no-first-run", "--no-default-browser-check", "--disable-extensions", "--disable-sync",
            "--disable-background-networking", "--disable-component-update", "--hide-scrollbars",
            "--force-device-scale-factor=1", f"--user-data-dir={profile}", f"--window-size={WIDTH},{HEIGHT}",
            "--enable-logging=stderr", "--v=0",  # the page's console messages and uncaught errors, for console()
            f"--virtual-time-budget={budget_ms}", f"--screenshot={shot}", "--dump-dom", url]
    with open(workdir / "chromium.log", "wb") as log:
        proc = await asyncio.create_subprocess_exec(*args, stdout=asyncio.subprocess.PIPE, stderr=log,
                                                    stdin=asyncio.subprocess.DEVNULL, start_new_session=True)
        try:
            dom, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
        except asyncio.TimeoutError:
            raise AssertionError(f"chromium did not finish within {timeout_s} s; its log: {workdir / 'chromium.log'}")
        finally:
            _kill_ours(proc, profile)
            await proc.wait()
    assert proc.returncode == 0, f"chromium exited with {proc.returncode}: {(workdir / 'chromium.log').read_text()[-2000:]}"
    assert not _ours(profile), "chromium processes outlived the test"
    return dom.decode(), shot


def console(workdir: Path) -> list[str]:
    """What the page wrote to the browser's console (errors, warnings, CSP refusals), from browse()'s log."""
    log = workdir / "chromium.log"
    return [line for line in log.read_text(errors="replace").splitlines() if ":CONSOLE" in line]


def assert_rendered_cleanly(dom: str, workdir: Path) -> None:
    """No problem banner, no panel that failed to draw, nothing in /status the page did not understand,
    nothing on the console: the page drew every panel from what it fetched."""
    assert 'class="shown"' not in dom, element(dom, r'<div id="problem-text">')
    body = re.search(r"<body([^>]*)>", dom).group(1)
    assert 'data-panel-errors="0"' in body and 'data-schema-problems="0"' in body, body
    boxes = re.findall(r'<div class="panel-error"([^>]*)>([^<]*)<', dom)
    assert len(boxes) == 7 and all(attrs == ' hidden=""' for attrs, _ in boxes), boxes
    assert 'id="schema-alert" class="alert warn" hidden=""' in dom
    assert not console(workdir), console(workdir)


def element(dom: str, pattern: str) -> str:
    """The text of the first element ``pattern`` (an opening tag's regex) matches, tags stripped."""
    m = re.search(pattern + r"(.*?)</(td|b|div|tbody|ul|section)>", dom, re.S)
    assert m, f"the rendered page has no {pattern!r}"
    return re.sub(r"<[^>]+>", "", m.group(1))


def row(dom: str, key: str, value: str) -> str:
    """The rendered table row ``<tr data-KEY="VALUE">`` (its HTML)."""
    found = re.search(rf'<tr data-{key}="{value}">(.*?)</tr>', dom, re.S)
    assert found, f"no table row for {key} {value}: the page did not render /status"
    return found.group(1)


def png_pixels(path: Path) -> np.ndarray:
    import matplotlib.image
    return (matplotlib.image.imread(path)[..., :3] * 255).round().astype(np.uint8)


def serve_and_browse(browser: str, tmp_path: Path, fragment: str, budget_ms: int, fake: FakeRun):
    async def main():
        async with StatusServer(fake, TransportMetrics(), token=TOKEN) as page:
            return await browse(browser, f"{page.url}/{fragment}", tmp_path, budget_ms)
    return arun(main())


@FORK_WARNING
def test_dashboard_in_headless_chromium_shows_live_numbers_and_draws_the_curves(chromium, tmp_path):
    fake = FakeRun()
    t0 = time.monotonic()
    dom, shot = serve_and_browse(chromium, tmp_path, f"#token={TOKEN}", 8000, fake)
    took = time.monotonic() - t0

    polls = int(re.search(r'<body [^>]*data-polls="(\d+)"', dom).group(1))
    assert 2 <= polls <= len(fake.served), (polls, len(fake.served))  # it polls, every ~2 s
    shown_loss = element(row(dom, "learner", "0"), r'<td data-k="loss">')
    shown_version = element(row(dom, "fragment", "0"), r'<td data-k="version">')
    # Both from the same later call: the page re-renders what it fetches, not the first answer only.
    matches = [n for n, s in enumerate(fake.served)
               if f"{s['learners']['0']['loss']:.4f}" == shown_loss and f"{s['versions'][0]:,}" == shown_version]
    assert matches and matches[0] >= 1, (shown_loss, shown_version, [s["versions"][0] for s in fake.served])
    row2 = row(dom, "learner", "2")
    assert "eu-west" in row2 and ">alive<" in row2 and "31,744" in row2
    assert element(dom, r'<b id="alive">') == "3 / 3"
    assert "<td>83.4</td><td>1.62</td>" in row(dom, "peer", "learner-2")
    events = element(dom, r'<ul id="events">')
    assert "learner 2 rejoined (eu-west)" in events and "learner 2 lost" in events
    assert "fragment 3 merged (due step" in events
    assert element(row(dom, "fragment", "3"), r'<td data-k="shard">') == "0"
    assert element(row(dom, "fragment", "1"), r'<td class="down" data-k="shard">') == "1 (down)"
    points = int(re.search(r'data-points="(\d+)"', dom).group(1))
    assert points >= sum(len(c) for c in fake.served[0]["loss_history"].values())
    assert 'id="problem" role="alert"' in dom and 'class="shown"' not in dom
    assert_rendered_cleanly(dom, tmp_path)
    assert TOKEN not in dom

    pixels = png_pixels(shot)
    assert pixels.shape == (HEIGHT, WIDTH, 3)
    colours = np.unique(pixels.reshape(-1, 3), axis=0)
    assert len(colours) > 200, f"the screenshot looks blank: {len(colours)} colours"
    for m, rgb in LEARNER_RGB.items():
        # Swatches alone are a few hundred pixels; a curve across the chart adds many more.
        drawn = int(np.all(pixels == rgb, axis=-1).sum())
        assert drawn > 600, f"learner {m}'s loss curve is not drawn ({drawn} pixels of {rgb})"
    print(f"chromium run: {took:.1f} s")


@FORK_WARNING
@pytest.mark.parametrize("fragment, says", [
    ("", "This dashboard needs the run's token (401)"),
    ("#token=not-the-token-0123456789", "The syncer refused this token (401)"),
])
def test_dashboard_without_the_right_token_says_so_and_shows_no_data(chromium, tmp_path, fragment, says):
    fake = FakeRun()
    dom, _ = serve_and_browse(chromium, tmp_path, fragment, 3000, fake)
    assert fake.served == []  # /status never answered with data
    assert '<div id="problem" role="alert" class="shown">' in dom
    assert says in element(dom, r'<div id="problem-text">')
    assert '<form id="auth">' in dom  # the token box is shown (no longer hidden)
    assert "data-learner" not in dom and "waiting for /status" in dom


class TroubledRun(FakeRun):
    """FakeRun with the fields #23's other parts add: a quarantined learner, refused messages, failing
    checkpoint writes and a start barrier still waiting."""

    def status(self, n: int) -> dict:
        st = super().status(n)
        st["learners"]["1"]["state"] = "quarantined"
        st["learners"]["2"] = {**st["learners"]["2"], "alive": None, "state": "waiting"}
        st["refused"] = {"metadata.step": 12, "clock": 3}
        st["storage"] = {"dir": "/ckpt/run-3f9a1c", "ok": False, "failures": 4,
                         "last_error": "[Errno 28] No space left on device", "free_bytes": 1536}
        st["barrier"] = {"need": 3, "joined": [0, 1], "waiting_for": [2], "started": False}
        return st


@FORK_WARNING
def test_dashboard_shows_refusals_quarantine_failing_writes_and_the_start_barrier_loudly(chromium, tmp_path):
    dom, _ = serve_and_browse(chromium, tmp_path, f"#token={TOKEN}", 3000, TroubledRun())
    assert_rendered_cleanly(dom, tmp_path)
    assert element(row(dom, "learner", "1"), r'<td class="text quarantined" data-k="state">') == "quarantined"
    assert element(row(dom, "learner", "2"), r'<td class="text waiting" data-k="state">') == "waiting"
    assert element(dom, r'<b id="alive">') == "1 / 3"  # only the alive one is up
    storage = element(dom, r'<div id="storage-alert" class="alert bad" role="alert">')
    assert "Checkpoint writes are failing in /ckpt/run-3f9a1c: 4 failed, 1.5 KiB free" in storage
    assert "[Errno 28] No space left on device" in storage
    assert element(dom, r'<b id="storage" class="bad">') == "FAILING (4)"
    assert "waiting for learner(s) 2" in element(dom, r'<div id="barrier-alert" class="alert warn">')
    assert element(dom, r'<b id="refused-total" class="bad">') == "15"
    assert "metadata.step" in row(dom, "field", "metadata.step") and ">12<" in row(dom, "field", "metadata.step")
    assert element(dom, r'<b id="quarantined" class="bad">') == "learner 1"
    assert element(dom, r'<b id="shards" class="bad">') == "2 (1 down)"


@FORK_WARNING
def test_a_status_of_another_shape_degrades_the_page_and_says_so(chromium, tmp_path):
    class OtherRun(FakeRun):
        def status(self, n: int) -> dict:
            st = super().status(n)
            del st["versions"]  # renamed, say
            st["shards"] = "two"
            st["learners"]["0"]["step"] = "1,480"
            st["events"] = {"0": "not a list"}
            st["storage"] = {"ok": "no"}
            return st

    dom, _ = serve_and_browse(chromium, tmp_path, f"#token={TOKEN}", 3000, OtherRun())
    body = re.search(r"<body([^>]*)>", dom).group(1)
    assert 'data-panel-errors="0"' in body and 'data-schema-problems="0"' not in body  # noticed, not thrown
    said = element(dom, r'<div id="schema-alert" class="alert warn">')
    assert "does not understand part of /status" in said and "status.versions is missing" in said
    assert 'class="shown"' not in dom  # no "Dashboard error": the rest of the page shows the run
    assert "eu-west" in row(dom, "learner", "2") and "no fragments" in element(dom, r'<tbody id="versions">')
    step0 = [re.sub(r"<[^>]+>", "", c) for c in re.findall(r"<td[^>]*>(.*?)</td>", row(dom, "learner", "0"))][3]
    assert step0 == "–"  # a step of the wrong type is unknown, not shown wrong


# ---- the screenshot in the docs ---------------------------------------------------------------

def save_screenshot(out: Path) -> None:
    """A realistic fake run, as the docs show it (``docs/dashboard.png``)."""
    import shutil
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        _, shot = serve_and_browse(CHROMIUM, Path(tmp), f"#token={TOKEN}", 8000, FakeRun())
        shutil.copyfile(shot, out)
    print(f"wrote {out} ({out.stat().st_size // 1024} KiB)")


if __name__ == "__main__":
    save_screenshot(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/dashboard.png"))
