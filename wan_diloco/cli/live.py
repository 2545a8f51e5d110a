"""What a person sees of a standalone `syncer` or `learner`: the live table `launch` shows and a summary at
the end, with the process's JSON events written to a file instead of the terminal (nothing lost).

Only when stdout is a terminal (or asked for): under `launch`, or piped, the process writes its JSON
events on stdout as before, for the launcher to read. ``--plain`` (a log, a scheduler) keeps them there and
adds, on stderr, `launch`'s plain progress lines and the summary as ``label: value`` lines.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.table import Table

from wan_diloco.cli import progress
from wan_diloco.cli.launch import table
from wan_diloco.cli.report import console as stderr_console
from wan_diloco.cli.report import human_bytes
from wan_diloco.runtime import events
from wan_diloco.runtime.launch import RunState
from wan_diloco.spec import RunSpec


def wanted(flag: bool | None) -> bool:
    """``--table`` / ``--no-table``; neither: a table when stdout is a terminal."""
    return sys.stdout.isatty() if flag is None else flag


def add_view_arguments(p: argparse.ArgumentParser) -> None:
    view = p.add_mutually_exclusive_group()
    view.add_argument("--table", dest="table", action="store_true", default=None,
                      help="a live table and a summary, the JSON events to --events (default when stdout is a terminal)")
    view.add_argument("--no-table", dest="table", action="store_false",
                      help="the JSON events on stdout, one per line (default when piped, as under launch)")
    view.add_argument("--plain", action="store_true",
                      help="the JSON events on stdout, and on stderr a progress line every --progress-every-s and "
                           "the summary as 'label: value' lines (a log file, a scheduler)")
    p.add_argument("--events", metavar="PATH",
                   help="with the table: where the JSON events go (default: run.run_dir/<process>-<time>.jsonl)")
    progress.add_progress_argument(p)


def open_view(cfg: RunSpec, name: str, args: argparse.Namespace) -> contextlib.AbstractContextManager:
    """What the flags ask for: a :class:`ProcessView` (table or plain), or nothing (JSON events only)."""
    if args.plain:
        return ProcessView(cfg, name, None, every_s=args.progress_every_s)
    if not wanted(args.table):
        return contextlib.nullcontext()
    return ProcessView(cfg, name, events_path(cfg, name, args.events))


def events_path(cfg: RunSpec, name: str, given: str | None) -> Path:
    return Path(given) if given else Path(cfg.run.run_dir) / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"


class ProcessView:
    """A context: while open, every event of this process goes to ``path`` (JSON lines, with its source)
    and into the table; on close, the summary of its final event. Without a path (plain): the events stay
    on stdout, and a progress line every ``every_s`` goes to the console instead of the table."""

    def __init__(self, cfg: RunSpec, name: str, path: Path | None, console: Console | None = None,
                 every_s: float = progress.DEFAULT_EVERY_S):
        self.cfg, self.name, self.path, self.every_s = cfg, name, path, every_s
        self.console = console or stderr_console
        self.mon = RunState(cfg)
        self.final: dict | None = None
        self.error: str | None = None
        self._lock = threading.Lock()  # events arrive on the process's threads; rich renders on its own

    def __enter__(self) -> "ProcessView":
        if self.path is None:
            self._file = sys.stdout  # where emit writes them unwatched: a launcher or a collector reads them there
            self._live = progress.Ticker(self._figures, lambda line: progress.write_lines([line], self.console.file),
                                         self.every_s, prefix=f"{self.name} progress")
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")
            self.console.print(f"{self.name}: events go to {self.path}", highlight=False)
            self._live = Live(get_renderable=self._render, console=self.console, refresh_per_second=2)
        self._live.__enter__()
        events.set_sink(self._take)
        return self

    def __exit__(self, *exc: object) -> None:
        events.set_sink(None)
        self._live.__exit__(None, None, None)
        if self.path is not None:
            self._file.close()
        self.print_summary()

    def _take(self, event: dict) -> None:
        tagged = event if self.path is None else {"source": self.name, **event}  # stdout's lines stay as emit's
        self._file.write(json.dumps(tagged, separators=(",", ":"), default=float) + "\n")
        self._file.flush()
        with self._lock:
            try:
                self.mon.fold(self.name, event)
            except (KeyError, TypeError, ValueError):
                pass  # an event the table cannot show: the file has it, and a display must not stop training
            if event.get("event") == "final":
                self.final = event
            elif event.get("event") == "error":
                self.error = event.get("error")

    def watch_syncer(self, status: dict, progress: dict) -> None:
        """The syncer's view of its learners (``SyncerService.status()`` and its ``progress``) as their rows:
        a standalone syncer sees no learner events, only what their metadata says."""
        with self._lock:
            if status.get("barrier"):
                self.mon.barrier = dict(status["barrier"])  # the table's caption: who the run waits for
            for key, seen in status["learners"].items():
                row, m = self.mon.learners[int(key)], int(key)
                row["step"] = seen["step"]
                row["status"] = ({"alive": "training", "lost": "lost", "waiting": "not seen", "quarantined": "quarantined"}
                                 .get(seen.get("state")) or {True: "training", False: "lost", None: "not seen"}[seen["alive"]])
                got = progress.get(m) or {}
                if got.get("loss") is not None:
                    row["loss"] = got["loss"]
                row["tokens"] = got.get("tokens", row.get("tokens", 0))
            self.mon.syncer["storage"] = status.get("storage")  # failing writes: a red row of the table
            for sender, link in status.get("links", {}).items():
                if sender.startswith("learner-") and sender[8:].isdigit() and int(sender[8:]) in self.mon.learners:
                    self.mon.learners[int(sender[8:])]["link"] = {k: link[k] for k in ("rtt_ms", "rate_gbit_s")}

    def _figures(self) -> progress.Progress:
        with self._lock:
            return progress.figures(self.mon)

    def _render(self) -> Table:
        with self._lock:
            mine = None if self.name.startswith("syncer") else [int(self.name.rpartition("-")[2])]  # shards too
            return table(self.mon, learners=mine)

    def print_summary(self) -> None:
        shown = []
        if self.final is None:
            shown.append(("ended", self.error or "before its final sync (stopped, or see the lines above)"))
        else:
            for label, fmt in SYNCER_ROWS if self.name.startswith("syncer") else LEARNER_ROWS:
                try:
                    shown.append((label, fmt(self.final)))
                except (KeyError, TypeError, ValueError, ZeroDivisionError):
                    continue  # a figure this run did not produce
        shown.append(("events", "on stdout" if self.path is None else str(self.path)))
        progress.show_rows(f"{self.name}: summary", shown, self.console)


def _loss(f: dict) -> str:
    return f"{f['initial_eval_loss']:.4f} -> {f['final_eval_loss']:.4f}"


LEARNER_ROWS = [
    ("eval loss (global model)", _loss),
    ("steps, tokens", lambda f: f"{f['steps']:,}, {f['tokens']:,}"),
    ("train time (computing)", lambda f: f"{f['train_s']:.1f} s ({f['compute_s'] / f['train_s']:.0%})"),
    ("bytes sent / received", lambda f: f"{human_bytes(f['bytes_sent'])} / {human_bytes(f['bytes_received'])}"),
    ("compression ratio", lambda f: f"{f['raw_bytes'] / f['payload_bytes']:.2f}x"),
    ("resyncs, rejoins", lambda f: f"{f['resyncs']}, {f['rejoins']}"),
    ("final fragments equal the syncer's", lambda f: "NO: " + str(f["digest_mismatch"]) if f.get("digest_mismatch") else "yes"),
]

SYNCER_ROWS = [
    ("global steps", lambda f: str(f["global_step"])),
    ("fragment syncs", lambda f: " ".join(map(str, f["fragment_syncs"]))),
    ("mean quorum (late Δs carried)", lambda f: f"{f['mean_quorum']:.2f} ({f['late_carried']})"),
    ("learners in the final sync", lambda f: ", ".join(map(str, f["final_learners"])) or "none"),
    ("bytes in / out", lambda f: f"{human_bytes(f['bytes_in'])} / {human_bytes(f['bytes_out'])}"),
    ("snapshots (run id, incarnation)", lambda f: f"{f['snapshots_complete']} ({f['run_id']}, {f['epoch']})"),
    ("final parameters", lambda f: f["params_path"] or (f"NOT WRITTEN: {f['params_error']}" if f.get("params_error")
                                                        else "not written (checkpoint.dir is empty)")),
]
