"""The ``datastore`` command's usage errors: one line on stderr naming the command and the
argument, exit 2, for every subcommand (argparse printed its usage block above the error, and
an unknown option of a command as the top command's)."""

from __future__ import annotations

import pytest

from datastore.cli import main


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["stage", "src", "--to", "d", "--streams", "x"],
         "argument --streams: must be a whole number >= 1, got 'x'"),
        (["stage", "src", "--to", "d", "--bogus"], "unrecognized arguments: --bogus"),
        (["stage", "src", "--to"], "argument --to: expected one argument"),
        (["inspect", "d.h5", "--layout", "rows"],
         "argument --layout: invalid choice: 'rows' (choose from 'shards', 'per-sample')"),
        (["inspect", "d.h5", "--bogus"], "unrecognized arguments: --bogus"),
        (["inspect"], "the following arguments are required: PATH"),
        (["plan", "--nodes", "0"], "argument --nodes: must be a whole number >= 1, got '0'"),
        (["plan", "--step-time", "-1"], "argument --step-time: must be a number > 0, got '-1'"),
        (["plan", "--bogus"], "unrecognized arguments: --bogus"),
        (["serve", "--workers", "x"], "argument --workers: must be a whole number >= 1, got 'x'"),
        (["serve", "--bogus"], "unrecognized arguments: --bogus"),
        (["status", "--timeout", "x"], "argument --timeout: not a number of seconds: 'x'"),
        (["status", "--bogus"], "unrecognized arguments: --bogus"),
        (["load", "d.h5", "--timeout", "0"],
         "argument --timeout: must be a finite number of seconds > 0, got '0'"),
        (["load", "d.h5", "--bogus"], "unrecognized arguments: --bogus"),
        (["unload", "d.h5", "--timeout", "nan"],
         "argument --timeout: must be a finite number of seconds > 0, got 'nan'"),
        (["unload", "d.h5", "--bogus"], "unrecognized arguments: --bogus"),
        (["shutdown", "--grace", "3601"], "argument --grace: must be 0..3600 seconds, got '3601'"),
        (["shutdown", "--bogus"], "unrecognized arguments: --bogus"),
    ],
)  # fmt: skip
def test_a_usage_error_of_a_command_is_one_line_naming_it(argv, says, capsys):
    assert main(argv) == 2
    command = f"datastore {argv[0]}"
    assert capsys.readouterr() == ("", f"{command}: error: {says} (see {command} --help)\n")


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        ([], "the following arguments are required: COMMAND"),
        (["stag"], "argument COMMAND: invalid choice: 'stag' (choose from 'stage', 'inspect', "
                   "'plan', 'serve', 'status', 'load', 'unload', 'shutdown')"),
        (["--bogus"], "the following arguments are required: COMMAND"),
    ],
)  # fmt: skip
def test_a_usage_error_of_the_top_command_is_one_line(argv, says, capsys):
    assert main(argv) == 2
    assert capsys.readouterr() == ("", f"datastore: error: {says} (see datastore --help)\n")


def test_help_and_version_still_exit_0(capsys):
    assert main(["serve", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: datastore serve [-h]") and "--workers WORKERS" in out
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("datastore ")


@pytest.mark.parametrize(
    ("argv", "argument"),
    [
        (["stage", "", "--to", "d"], "SRC"),
        (["stage", "src", "--to", ""], "--to"),
        (["stage", "src", "--to", "d", "--confine", ""], "--confine"),
        (["stage", "src", "--to", "d", "--service", "s.sock", "--token-file", ""], "--token-file"),
        (["stage", "src", "--to", "d", "--service", "s.sock", "--tls-ca", ""], "--tls-ca"),
        (["inspect", ""], "PATH"),
        (["plan", ""], "DATASET"),
        (["plan", "--machine", ""], "--machine"),
        (["load", ""], "path"),
        (["unload", ""], "path"),
    ],
)
def test_an_empty_path_is_a_usage_error_naming_it(argv, argument, capsys):
    """An empty path (an unset variable) was the working directory: ``stage --confine ""``
    started in ``/`` staged from anywhere, ``plan --machine ""`` planned with the defaults
    and ``load ""`` asked for the working directory."""
    assert main(argv) == 2
    command = f"datastore {argv[0]}"
    said = f"{command}: error: argument {argument}: an empty path (see {command} --help)\n"
    assert capsys.readouterr() == ("", said)


@pytest.mark.parametrize("flag", ["--load", "--token-file", "--tls-ca"])
def test_a_service_option_without_service_is_refused(flag, tmp_path, capsys):
    """``--token-file`` without ``--service`` staged here and ignored it, where ``--load`` and
    ``--tls-ca`` were refused."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.bin").write_bytes(b"a")
    (tmp_path / "secret").write_text("s")
    value = [] if flag == "--load" else [str(tmp_path / "secret")]
    argv = ["stage", str(tmp_path / "src"), "--to", str(tmp_path / "dst"), flag, *value]
    assert main(argv) == 2
    said = f"datastore stage: error: {flag} needs --service (it is about the service)\n"
    assert capsys.readouterr() == ("", said)
    assert not (tmp_path / "dst").exists()


def test_verify_without_a_manifest_counts_the_error_in_its_summary(tmp_path, capsys):
    """The summary said ``verified 0 entries: 0 problem(s)`` beside the error and exit 1."""
    assert main(["stage", "--verify", "--to", str(tmp_path)]) == 1
    err = f"datastore stage: verify: {tmp_path}: no manifest (nothing was staged here with "
    err += "datastore stage)\n"
    assert capsys.readouterr() == ("verified 0 entries: 0 problem(s); 1 error(s)\n", err)
