"""A command's console: under ``python -u`` each line on stderr is one write (the errors of
ranks sharing a terminal never run together), and a reader of stdout that goes away
(``| head``) ends the command quietly with exit code 141."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import h5py
import numpy as np
from helpers import ROOT, ctrl_c_heard, job_env

from trainer.cosmology import write_split


def _writes(argv: list[str]) -> tuple[int, list[bytes]]:
    """Run ``python -u ARGV`` with its stderr a ``SOCK_SEQPACKET`` socket, where each
    ``write`` arrives as one message: ``(exit code, the messages)``."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with ours:
        with theirs:
            cmd = [sys.executable, "-u", *argv]
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=theirs, env=job_env())
        ours.settimeout(120)
        messages = []
        while message := ours.recv(1 << 16):
            messages.append(message)
    return proc.wait(timeout=120), messages


def test_print_under_python_u_writes_a_line_in_two_pieces():
    """What the commands guard against, seen by this test's means: ``print`` to stderr under
    ``python -u`` writes the text, then the newline."""
    code, writes = _writes(["-c", "import sys; print('a line', file=sys.stderr)"])
    assert (code, writes) == (0, [b"a line", b"\n"])


def test_an_error_of_the_datastore_command_is_one_write(tmp_path):
    code, writes = _writes(["-m", "datastore", "stage", str(tmp_path / "nope"), "--to", "d"])
    assert code == 2
    assert writes and all(w.endswith(b"\n") and w.count(b"\n") == 1 for w in writes), writes
    assert str(tmp_path / "nope").encode() in b"".join(writes)


def test_an_error_of_the_trainer_is_one_write(tmp_path):
    code, writes = _writes(["-m", "trainer", "train", "--set", f"data={tmp_path}"])
    assert code == 2
    assert writes == [writes[0]] and writes[0].startswith(b"trainer: "), writes
    assert writes[0].endswith(b"\n") and writes[0].count(b"\n") == 1


def test_a_reader_gone_ends_the_command_quietly_with_141(tmp_path):
    """``datastore inspect DATA | head -0``: the pipe's reader has gone before the command
    writes; it ends with the code a shell reports for SIGPIPE and says nothing (was: an
    'internal error: BrokenPipeError' line and exit 1)."""
    data = tmp_path / "d.h5"
    with h5py.File(data, "w") as f:
        f["x"] = np.zeros((8, 4, 4), np.float32)
    cmd = [sys.executable, "-m", "datastore", "inspect", str(data)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=job_env())
    proc.stdout.close()  # (before the interpreter has even started)
    err = proc.stderr.read()
    assert (proc.wait(timeout=60), err) == (141, b"")


def test_a_reader_gone_ends_a_training_quietly_with_141(tmp_path):
    """``python -m trainer train ... | head -2``: rank 0's next line finds the reader gone;
    the run ends with 141 and says nothing (was: a BrokenPipeError traceback, exit 1)."""
    write_split(tmp_path, 16, 8, 8, 0)
    cmd = [sys.executable, "-m", "trainer", "train", "--config",
           str(ROOT / "trainer/configs/cosmoflow.toml"), "--set", f"data={tmp_path}",
           "--set", "epochs=4", "--set", "warmup=1", "--set", "print_every=1", "--set",
           f"checkpoint_dir={tmp_path}/run", "--set", f"log_file={tmp_path}/log"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=job_env())
    proc.stdout.close()
    err = proc.stderr.read()
    assert (proc.wait(timeout=120), err) == (141, b"")


def test_a_pipe_still_read_is_not_a_reader_gone():
    """A ``BrokenPipeError`` while stdout is still read (a socket's, say) stays an error."""
    code = "from staging.console import reader_gone; print(reader_gone())"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=job_env(), timeout=60
    )
    assert (out.returncode, out.stdout, out.stderr) == (0, "False\n", "")


def test_ctrl_c_ends_a_training_with_one_line_and_130(tmp_path):
    """SIGINT mid-run: ``trainer: interrupted`` and exit 130 (was: a KeyboardInterrupt
    traceback, a code the docs did not list)."""
    write_split(tmp_path, 16, 8, 8, 0)
    log = tmp_path / "log"
    cmd = [sys.executable, "-m", "trainer", "train", "--config",
           str(ROOT / "trainer/configs/cosmoflow.toml"), "--set", f"data={tmp_path}",
           "--set", "epochs=1000", "--set", "log_every=1", "--set",
           f"checkpoint_dir={tmp_path}/run", "--set", f"log_file={log}"]  # fmt: skip
    proc = subprocess.Popen(
        ctrl_c_heard(cmd),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=job_env(),
    )  # (a test run in the background ignores SIGINT)
    try:
        deadline = time.monotonic() + 120
        while not (log.exists() and '"loss"' in log.read_text()):  # training: a step logged
            assert proc.poll() is None and time.monotonic() < deadline, "no step logged"
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        err = proc.stderr.read()
        assert (proc.wait(timeout=60), err) == (130, "trainer: interrupted\n")
    finally:
        proc.kill()
        proc.wait()
