"""Output for a log file or CI, where a live table cannot redraw: one plain ``key=value`` progress line every few
seconds, and summaries as ``label: value`` lines that no terminal width cuts (full paths stay copyable)."""
from __future__ import annotations

import argparse
import threading
import time
from dataclasses import dataclass
from typing import Callable, TextIO

from rich.console import Console
from rich.table import Table

from wan_diloco.cli.report import human_bytes
from wan_diloco.runtime.launch import RunState
from wan_diloco.runtime.launch_summary import first_starts

DEFAULT_EVERY_S = 10.0


@dataclass(frozen=True)
class Progress:
    """What one progress line says, read from a run's state at one moment."""
    step: int  # the furthest global step seen (the syncer's, or a learner's on the shared schedule)
    budget_steps: int
    tokens: int  # all learners together
    learners_training: int  # stepping now, or done stepping and in their final sync (still part of the run)
    learners: int
    eval_loss: float | None = None  # the global model's latest eval point, and its step
    eval_step: int | None = None
    up_bytes: int = 0  # learners -> syncer
    down_bytes: int = 0  # syncer -> learners
    mean_quorum: float | None = None  # learners per merge so far (the syncer's figure)
    learners_final_sync: int = 0  # of learners_training, those past their last step, sending their last fragments


def figures(mon: RunState) -> Progress:
    """``mon`` as one :class:`Progress` (a copy: safe to hand to another thread)."""
    rows = mon.learners.values()
    syncers = [s for s in (mon.syncer, *mon.shards.values()) if "bytes_in" in s]  # shard 0 and the others
    step = max([int(s.get("global_step") or 0) for s in syncers] + [int(r.get("step") or 0) for r in rows] + [0])
    # Before the first eval point (run.eval_every_steps), the global model's loss the learners started from.
    last = mon.evals[-1] if mon.evals else next(
        ({"step": e.get("step", 0), "eval_loss": e["eval_loss"]} for e in first_starts(mon).values()
         if e.get("eval_loss") is not None), None)
    # The syncers' counts, when heard: they include every learner's, also one restarted by hand.
    up = sum(int(s["bytes_in"]) for s in syncers) if syncers else sum(r.get("bytes_sent") or 0 for r in rows)
    down = (sum(int(s.get("bytes_out", 0)) for s in syncers) if syncers
            else sum(r.get("bytes_received") or 0 for r in rows))
    return Progress(
        step=step, budget_steps=mon.cfg.run.steps, tokens=sum(int(r.get("tokens") or 0) for r in rows),
        learners_training=sum(r.get("status") in ("training", "final sync") for r in rows),
        learners_final_sync=sum(r.get("status") == "final sync" for r in rows), learners=len(mon.learners),
        eval_loss=last["eval_loss"] if last else None, eval_step=last["step"] if last else None,
        up_bytes=int(up), down_bytes=int(down),
        mean_quorum=next((s["mean_quorum"] for s in syncers if s.get("mean_quorum")), None))


def progress_line(p: Progress, elapsed_s: float, tokens_per_s: float | None, eta_s: float | None,
                  prefix: str = "progress") -> str:
    """One line, the same keys in the same order every time (``-``: not known yet), no spaces inside a value:
    ``grep progress``, ``cut`` and ``awk -F'[ =]'`` all read it."""
    def size(n: int) -> str:
        return human_bytes(n).replace(" ", "")

    fields = [
        ("elapsed_s", f"{elapsed_s:.0f}"),
        ("step", f"{p.step}/{p.budget_steps}"),
        ("tokens", str(p.tokens)),
        ("tokens_per_s", "-" if tokens_per_s is None else f"{tokens_per_s:.0f}"),
        ("eval_loss", "-" if p.eval_loss is None else f"{p.eval_loss:.4f}@{p.eval_step}"),
        ("up", size(p.up_bytes)),
        ("down", size(p.down_bytes)),
        ("quorum", "-" if p.mean_quorum is None else f"{p.mean_quorum:.2f}"),
        ("learners", f"{p.learners_training}/{p.learners}"),
        ("final_sync", str(p.learners_final_sync)),
        ("eta_s", "-" if eta_s is None else f"{eta_s:.0f}"),
    ]
    return " ".join([prefix, *(f"{k}={v}" for k, v in fields)])


class Ticker:
    """A context: while open, a line from ``read()`` every ``every_s`` seconds to ``write`` (on its own thread).
    tokens/s is the rate since the previous line; the ETA extrapolates the steps per second since training began."""

    def __init__(self, read: Callable[[], Progress], write: Callable[[str], None], every_s: float,
                 prefix: str = "progress", clock: Callable[[], float] = time.monotonic):
        self.read, self.write, self.every_s, self.prefix, self.clock = read, write, every_s, prefix, clock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="progress-lines", daemon=True)

    def __enter__(self) -> "Ticker":
        self.t0 = self.clock()
        self._last: tuple[float, int] = (self.t0, 0)  # (time, tokens) at the previous line
        self._began: tuple[float, int] | None = None  # (time, step) when steps were first seen
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def line(self) -> str:
        """The next line (also what the thread writes)."""
        now, p = self.clock(), self.read()
        t_last, tokens_last = self._last
        rate = (p.tokens - tokens_last) / (now - t_last) if now > t_last and p.tokens else None
        self._last = (now, p.tokens)
        eta = None
        if p.step > 0 and self._began is None:
            self._began = (now, p.step)
        elif self._began is not None and p.step > self._began[1]:
            t_began, step_began = self._began
            eta = max(0, p.budget_steps - p.step) * (now - t_began) / (p.step - step_began)
        return progress_line(p, now - self.t0, rate, eta, self.prefix)

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                line = self.line()
            except (KeyError, TypeError, ValueError):
                continue  # a figure an odd event left unreadable: the next line, not a traceback in the log
            self.write(line)


def show_rows(title: str, rows: list[tuple[str, str]], console: Console) -> None:
    """A summary: a table in a terminal (a value too wide for it folds onto the next line, whole); elsewhere (a
    log, CI) ``label: value`` lines, never cut or wrapped."""
    if console.is_terminal:
        t = Table(title=title, show_header=False)
        t.add_column(no_wrap=True)
        t.add_column(overflow="fold")  # a narrow terminal breaks a long path, never cuts it
        for label, value in rows:
            t.add_row(label, value)
        console.print(t)
        return
    lines = [f"{title}:", *(f"  {label}: {value}" for label, value in rows)]
    write_lines(lines, console.file)


def write_lines(lines: list[str], file: TextIO) -> None:
    file.write("".join(line + "\n" for line in lines))
    file.flush()  # a log collector shows each line as it comes


def every_s(text: str) -> float:
    """``--progress-every-s``: seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text}")
    return value


def add_progress_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--progress-every-s", type=every_s, default=DEFAULT_EVERY_S, metavar="S",
                   help=f"with plain output: seconds between progress lines (default {DEFAULT_EVERY_S:g})")
