"""The console of `lightning-tlt fit` in a real terminal (a pseudo-terminal): the per-step lines, the validation
line and the run's summary are whole lines above the progress bar, never erased by its redraw nor glued to it."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import threading
from pathlib import Path

import pytest
import yaml
from test_cli import tiny_config

from lightning_tlt.callbacks.rollout_metrics import run_summary

ROOT = Path(__file__).parent.parent.parent
_ESCAPE = re.compile(r"\x1b\[([?\d;]*)([A-Za-z])")


def screen(data: str, width: int) -> list[str]:
    """What a terminal ``width`` columns wide shows (scrollback included) after ``data``: a small emulator of
    the controls progress bars use (carriage return, cursor up/down/column, erase line, auto-wrap). A line the
    terminal wrapped is given back whole."""
    lines: list[list[str]] = [[]]
    wrapped: set[int] = set()  # rows that continue the row above (auto-wrap)
    row = col = 0
    i = 0
    while i < len(data):
        char = data[i]
        match = _ESCAPE.match(data, i) if char == "\x1b" else None
        if match is not None:
            params, cmd = match.groups()
            n = int(params) if params.isdigit() else 1
            if cmd == "A":
                row = max(0, row - n)
            elif cmd == "B":
                row += n
            elif cmd == "G":
                col = n - 1
            elif cmd == "K":  # 2: the whole line; 0 or none: from the cursor on
                lines[row] = [] if params == "2" else lines[row][:col]
                if params == "2" or col == 0:
                    wrapped.discard(row)
            i = match.end()
            continue
        if char == "\x1b":  # another escape (e.g. OSC): skip its introducer
            i += 2
            continue
        if char == "\r":
            col = 0
        elif char == "\n":
            row, col = row + 1, 0
        elif char >= " ":
            if col >= width:
                row, col = row + 1, 0
                wrapped.add(row)
            while len(lines) <= row:
                lines.append([])
            line = lines[row]
            line.extend(" " * (col + 1 - len(line)))
            line[col] = char
            col += 1
        while len(lines) <= row:
            lines.append([])
        i += 1
    out: list[str] = []
    for i, line in enumerate(lines):
        text = "".join(line)
        if i in wrapped and out:
            out[-1] = out[-1] + text
        else:
            out.append(text)
    return [line.rstrip() for line in out]


def run_in_terminal(argv: list[str], width: int, cwd: Path) -> str:
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, width, 0, 0))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": str(width), "TERM": "xterm-256color"}
    env.pop("NO_COLOR", None)
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, cwd=cwd, close_fds=True)
    os.close(slave)
    chunks: list[bytes] = []

    def read() -> None:
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                return
            if not chunk:
                return
            chunks.append(chunk)

    reader = threading.Thread(target=read)
    reader.start()
    proc.wait(timeout=300)
    reader.join(timeout=10)
    os.close(master)
    return b"".join(chunks).decode("utf-8", errors="replace")


@pytest.mark.parametrize(("width", "bar"), [(120, "default"), (220, "default"), (120, "TQDMProgressBar")])
def test_step_lines_survive_the_progress_bar_in_a_terminal(tmp_path: Path, width: int, bar: str) -> None:
    path = tiny_config(tmp_path)
    config = yaml.safe_load(path.read_text())
    config["trainer"].update(max_steps=4, val_check_interval=2, enable_progress_bar=True)
    config["trainer"]["callbacks"].append({"class_path": "lightning_tlt.callbacks.rollout_progress.RolloutProgressCallback"})
    if bar != "default":  # Lightning's default is Rich where rich is installed
        config["trainer"]["callbacks"].append({"class_path": f"lightning.pytorch.callbacks.{bar}"})
    path.write_text(yaml.safe_dump(config))
    raw = run_in_terminal([sys.executable, "-m", "lightning_tlt.cli", "fit", "--config", str(path)], width, tmp_path)
    shown = screen(raw, width)
    text = "\n".join(shown)
    assert "Traceback" not in text, text
    steps = [line for line in shown if re.match(r"^step \d/4 \|", line)]
    assert [line.split(" |")[0] for line in steps] == ["step 1/4", "step 2/4", "step 3/4", "step 4/4"], text
    for line in steps:  # each whole: ends with the step's time, nothing of the bar glued to it
        assert re.search(r"\| \d+\.\d\d s$", line), line
    assert not [line for line in shown if re.search(r"\S(step \d/4 \|)", line)], text  # no line glued before one
    assert "columns of the per-step lines below:" in shown
    validations = [line for line in shown if re.match(r"^validation at step \d \| reward ", line)]
    assert len(validations) == 2 and all(re.search(r"\| \d+\.\d\d s$", v) for v in validations), text
    summary = shown.index(next(line for line in shown if line.startswith("done: 4 RL steps, optimizer step 4")))
    assert shown[summary + 1].startswith("  train:     arithmetic_correctness") or shown[summary + 1].startswith(
        "  train:     correctness"), text
    assert any(line.startswith("  held-out:  correctness") for line in shown[summary:]), text
    assert any(line.startswith("  metrics:   ") and line.endswith("metrics.csv") for line in shown[summary:]), text


def test_the_run_summary_says_what_was_learned_and_where_it_went() -> None:
    history = [{"step": 2 * i + 2, "reward": 1.0, "rewards/countdown_correctness/mean": c,
                "rewards/countdown_format/mean": 1.0, "spec/fraction": 0.5, "spec/accept_len": 2.0 + i / 10}
               for i, c in enumerate([0.2, 0.3, 0.4, 0.5, 0.6, 0.8])]
    state = {"history": history, "fit_s": 75.4, "validations": [
        {"step": 4, "seconds": 2.0, "rewards/countdown_correctness/mean": 0.25},
        {"step": 12, "seconds": 3.5, "rewards/countdown_correctness/mean": 0.5}]}
    text = run_summary(state, {"metrics": "runs/x/metrics.csv", "checkpoint": "runs/x/c.ckpt"}, steps_per_pass=2)
    assert text.splitlines() == [
        "done: 6 RL steps, optimizer step 12, in 1 min 15 s (5.5 s of it validating)",
        "  train:     correctness 0.250 -> 0.700, format 1.000 -> 1.000 (first vs last pass over the prompts: "
        "steps 2-4 -> 10-12)",
        "  held-out:  correctness 0.500 at step 12 (first, at step 4: correctness 0.250)",
        "  speculation: 50% of decode steps, accept 2.10 -> 2.40 tokens per speculative step (first vs last half "
        "of the speculating steps)",
        "  metrics:   runs/x/metrics.csv",
        "  checkpoint: runs/x/c.ckpt",
    ]
