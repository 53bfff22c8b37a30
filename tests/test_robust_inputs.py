"""Bad input a flag, a YAML spec, a setting or a file reference can carry: refused before any
work with exit 2, naming the flag, file or setting; never a traceback, a hang or a job left
behind (issue 33, items 4-8)."""

from __future__ import annotations

import json
import os

import pytest

from dflash_batch.cli import main
from dflash_batch.runner.spec import SpecError, cron_fields, load_spec
from tests.runner_fixtures import cli, fake_models, home, write_jsonl  # noqa: F401  (fixtures)

PROMPT = {"id": "a", "prompt": "Say hi."}


def job_records(home_dir):
    jobs = home_dir / "jobs"
    return sorted(jobs.iterdir()) if jobs.is_dir() else []


def refused(capsys, *argv) -> str:
    """Run the command in this process; it must exit 2 without a traceback. Its stderr."""
    try:
        code = main(list(map(str, argv)))
    except SystemExit as stop:  # argparse refuses a flag's value this way
        code = stop.code
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    return err


# -- 33.5: @FILE references ----------------------------------------------------------------------
def test_response_format_file_must_be_a_small_regular_file(tmp_path, home, capsys):
    data = write_jsonl(tmp_path / "ok.jsonl", [PROMPT])
    (tmp_path / "folder").mkdir()
    err = refused(capsys, "submit", data, "--response-format", "@missing")
    assert "missing: no such file" in err
    err = refused(capsys, "submit", data, "--response-format", f"@{tmp_path / 'folder'}")
    assert "--response-format" in err and "not a regular file" in err
    err = refused(capsys, "submit", data, "--response-format", "@/dev/zero")
    assert "/dev/zero: not a regular file" in err
    good = tmp_path / "format.json"
    good.write_text('{"type": "json_object"}')
    assert main(["submit", str(data), "--response-format", f"@{good}"]) == 0
    assert len(job_records(home)) == 1  # only the accepted submit left a record


def test_response_format_fifo_is_refused_at_once(tmp_path, home):
    data = write_jsonl(tmp_path / "ok.jsonl", [PROMPT])
    os.mkfifo(tmp_path / "fifo")  # no writer: reading it would block forever
    fifo = f"@{tmp_path / 'fifo'}"
    out = cli("submit", data, "--response-format", fifo, home=home, timeout=120)
    assert out.returncode == 2 and "not a regular file" in out.stderr
    assert "Traceback" not in out.stderr
    assert not job_records(home)


def test_spec_file_must_be_a_small_regular_file(tmp_path, monkeypatch):
    os.mkfifo(tmp_path / "job.yaml")
    with pytest.raises(SpecError, match="job.yaml: not a regular file"):
        load_spec(tmp_path / "job.yaml")
    (tmp_path / "dir.yaml").mkdir()
    with pytest.raises(SpecError, match="dir.yaml: not a regular file"):
        load_spec(tmp_path / "dir.yaml")
    monkeypatch.setattr("dflash_batch.runner.spec.SPEC_FILE_BYTES", 100)
    (tmp_path / "big.yaml").write_text("input: x.jsonl\n" + "# padding\n" * 20)
    with pytest.raises(SpecError, match=r"big.yaml: \d+ bytes, more than the 100 allowed"):
        load_spec(tmp_path / "big.yaml")


# -- 33.6: YAML aliases ----------------------------------------------------------------------------
def laughs(levels: int) -> str:
    lines = ["input: ok.jsonl", "chat_template_kwargs:", "  a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    for i in range(1, levels + 1):
        lines.append(f"  a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


def test_yaml_alias_expansion_is_bounded(tmp_path, home, capsys):
    write_jsonl(tmp_path / "ok.jsonl", [PROMPT])
    spec = tmp_path / "laughs.yaml"
    spec.write_text(laughs(9))  # about 1 KB; 9**10 values expanded
    err = refused(capsys, "submit", spec)
    assert "laughs.yaml: invalid YAML: more than 100000 values with its aliases expanded" in err
    assert not job_records(home)
    (tmp_path / "loop.yaml").write_text("input: ok.jsonl\nchat_template_kwargs: {x: &a [1, *a]}\n")
    with pytest.raises(SpecError, match="loop.yaml: invalid YAML: an alias on line 2 refers to"):
        load_spec(tmp_path / "loop.yaml")
    nested = "[" * 5000 + "]" * 5000
    (tmp_path / "deep.yaml").write_text(f"input: ok.jsonl\nchat_template_kwargs: {{x: {nested}}}\n")
    with pytest.raises(SpecError, match="deep.yaml: invalid YAML: nests too deeply to read"):
        load_spec(tmp_path / "deep.yaml")


def test_modest_yaml_aliases_still_work(tmp_path):
    write_jsonl(tmp_path / "ok.jsonl", [PROMPT])
    (tmp_path / "few.yaml").write_text(laughs(2) + "sampling: {stop: &s ['\\n\\n']}\n")
    spec = load_spec(tmp_path / "few.yaml")
    assert spec.chat_template_kwargs["a2"][0] == spec.chat_template_kwargs["a1"]
    assert len(spec.chat_template_kwargs["a2"]) == 9


# -- 33.8: cron expressions ------------------------------------------------------------------------
@pytest.mark.parametrize("expression, message", [
    ("30-10 * * * *", r"bad minute field '30-10' \(range '30-10' is reversed"),
    ("0 0 * * 5-1", r"bad day_of_week field '5-1' \(range '5-1' is reversed"),
    ("*/0 * * * *", r"bad minute field '\*/0' \(step '\*/0' is 0"),
    ("0 1-5/0 * * *", r"bad hour field '1-5/0' \(step '1-5/0' is 0"),
    ("1,,2 * * * *", r"bad minute field '1,,2' \(has an empty list item"),
    ("60 * * * *", r"bad minute field '60'"),
    ("0 0 0 * *", r"bad day field '0'"),
    ("0 0 31 2 *", r"day '31' never occurs in month '2'"),
    ("0 0 31 4,6 *", r"day '31' never occurs in month '4,6'"),
])  # fmt: skip
def test_cron_expressions_cron_would_refuse(expression, message):
    with pytest.raises(ValueError, match=message):
        cron_fields(expression)


def test_cron_expressions_that_fire_are_kept():
    fine = ("10-30 * * * *", "0 0 29 2 *", "0 0 31 1-12 *", "0 0 * * 0-7", "*/90 * * * *", "@daily")
    for expression in fine:
        assert len(cron_fields(expression)) == 5


def test_reversed_cron_range_is_refused_at_submit(tmp_path, home, capsys):
    write_jsonl(tmp_path / "ok.jsonl", [PROMPT])
    (tmp_path / "nightly.yaml").write_text("input: ok.jsonl\nschedule: '30-10 * * * *'\n")
    err = refused(capsys, "submit", tmp_path / "nightly.yaml")
    assert "'schedule'" in err and "reversed" in err
    assert not (home / "schedules").exists() and not job_records(home)


# -- 33.7: homes and settings ----------------------------------------------------------------------
def test_home_that_is_not_a_folder_is_refused(tmp_path, home, capsys):
    data = write_jsonl(tmp_path / "ok.jsonl", [PROMPT])
    for command in ("submit", "status"):
        for bad in ("/dev/null", data):
            argv = ["--home", bad, command] + ([data] if command == "submit" else [])
            assert f"--home {bad} is not a folder" in refused(capsys, *argv)
    home.parent.joinpath("file").write_text("")
    os.environ["DFLASH_BATCH_HOME"] = str(home.parent / "file")  # restored by the home fixture
    assert "$DFLASH_BATCH_HOME" in refused(capsys, "run", data)


def test_read_only_home_is_refused_before_any_work(
    tmp_path, home, fake_models, capsys, monkeypatch
):
    import errno

    def read_only(folder):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr("dflash_batch.runner.jobs._probe_write", read_only)
    data = write_jsonl(tmp_path / "ok.jsonl", [PROMPT])
    for command in ("run", "submit", "worker"):
        err = refused(capsys, command, data) if command != "worker" else refused(capsys, command)
        assert f"$DFLASH_BATCH_HOME {home}: cannot write there (Read-only file system)" in err
    assert not job_records(home)


@pytest.mark.parametrize("value", ["abc", "0", "nan", "-1", "inf"])
def test_bad_lease_setting_is_refused(tmp_path, home, fake_models, capsys, monkeypatch, value):
    monkeypatch.setenv("DFLASH_BATCH_LEASE_S", value)
    data = write_jsonl(tmp_path / "ok.jsonl", [PROMPT])
    for argv in (["submit", data], ["run", data, "-q"], ["status"]):
        err = refused(capsys, *argv)
        msg = f"$DFLASH_BATCH_LEASE_S must be a number of seconds in [1, 86400], got {value!r}"
        assert msg in err
    assert not job_records(home)


@pytest.mark.parametrize("name, value", [
    ("DFLASH_BATCH_DRAFTS", "forest"), ("DFLASH_BATCH_ATTENTION", ""), ("DFLASH_BATCH_PASSES", "x"),
    ("DFLASH_BATCH_KERNEL_CHECK", "yes"), ("DFLASH_BATCH_MEMORY_GB", "nan"),
    ("DFLASH_BATCH_MEMORY_GB", "-1"), ("DFLASH_BATCH_MEMORY_GB", "abc"),
    ("DFLASH_BATCH_MEMORY_GB", "inf"), ("DFLASH_BATCH_CACHE", "/dev/null"),
])  # fmt: skip
def test_bad_engine_setting_is_refused_before_the_job(
    tmp_path, home, monkeypatch, capsys, name, value
):
    import dflash_batch
    from dflash_batch.errors import SettingError

    monkeypatch.delenv("DFLASH_BATCH_ENGINE", raising=False)
    monkeypatch.setenv(name, value)
    data = write_jsonl(tmp_path / "ok.jsonl", [PROMPT])
    if value == "":  # unset in effect: the default mode
        from dflash_batch.api import check_engine_settings

        check_engine_settings()
        return
    with pytest.raises(SettingError, match=name):
        dflash_batch.run(data, home=home)
    assert name in refused(capsys, "run", data, "-q")
    assert not job_records(home)


def test_engine_factory_setting_is_checked_before_the_job(tmp_path, home, monkeypatch, capsys):
    data = write_jsonl(tmp_path / "ok.jsonl", [PROMPT])
    monkeypatch.setenv("DFLASH_BATCH_ENGINE", "no_such_module:load")
    err = refused(capsys, "run", data)
    assert "$DFLASH_BATCH_ENGINE='no_such_module:load' names no engine factory" in err
    monkeypatch.setenv("DFLASH_BATCH_ENGINE", "os:sep")
    assert "names str, not a factory" in refused(capsys, "run", data)
    assert not job_records(home)


# -- 33.4: Redis URLs ------------------------------------------------------------------------------
@pytest.fixture
def loopback_servers():
    """{"silent": port, "garbage": port, "closed": port}: servers on 127.0.0.1 that are not Redis.
    ``silent`` takes connections (the kernel's backlog) and never answers; ``garbage`` answers
    each with an HTTP error; ``closed`` is a port nothing listens on."""
    import socket
    import threading

    silent = socket.create_server(("127.0.0.1", 0), backlog=16)
    garbage = socket.create_server(("127.0.0.1", 0), backlog=16)
    closed = socket.create_server(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    closed.close()

    stop = threading.Event()

    def answer_garbage():
        while True:
            conn, _ = garbage.accept()
            with conn:
                if stop.is_set():  # the test's own wake-up call
                    return
                conn.recv(1024)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

    thread = threading.Thread(target=answer_garbage, daemon=True)
    thread.start()
    ports = {"silent": silent, "garbage": garbage}
    yield {"closed": closed_port, **{k: s.getsockname()[1] for k, s in ports.items()}}
    stop.set()
    socket.create_connection(garbage.getsockname()).close()
    thread.join()
    silent.close()
    garbage.close()


@pytest.mark.parametrize("kind, message", [
    ("silent", "no answer within 0.5 s"),
    ("garbage", "no Redis server answers there (InvalidResponse"),
    ("closed", "no Redis server answers there (ConnectionError"),
    ("no-scheme", "not a Redis URL"),
    ("bad-port", "not a Redis URL (Port could not be cast"),
])  # fmt: skip
def test_unusable_redis_is_refused_before_the_job_exists(
    tmp_path, home, fake_models, capsys, monkeypatch, loopback_servers, kind, message
):
    monkeypatch.setattr("dflash_batch.runner.queue.REDIS_CHECK_TIMEOUT_S", 0.5)
    monkeypatch.setenv("DFLASH_BATCH_REDIS_URL", "")  # main sets it from --redis; restored after
    url = {"no-scheme": "127.0.0.1:6379", "bad-port": "redis://127.0.0.1:port/0"}.get(kind)
    url = url or f"redis://:secret@127.0.0.1:{loopback_servers[kind]}/0"
    data = write_jsonl(tmp_path / "ok.jsonl", [PROMPT])
    for argv in (["submit", data], ["status"], ["worker"]):
        err = refused(capsys, "--redis", url, *argv)
        assert "--redis / $DFLASH_BATCH_REDIS_URL" in err and message in err
        assert "secret" not in err
    assert not job_records(home)  # so no later plain worker runs a job refused here


# -- the sweep: other values a flag or spec carries ---------------------------------------------
def test_output_dir_that_cannot_be_a_folder_is_refused(
    tmp_path, home, fake_models, capsys, monkeypatch
):
    import errno

    data = write_jsonl(tmp_path / "ok.jsonl", [PROMPT])
    os.mkfifo(tmp_path / "fifo")
    for out in ("/dev/null", data, tmp_path / "fifo", data / "below"):
        for command in ("run", "submit"):
            err = refused(capsys, command, data, "-o", out)
            assert f"output_dir {out}" in err
    from dflash_batch.runner import jobs

    real = jobs._probe_write

    def read_only(folder):
        if folder != home:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        real(folder)

    monkeypatch.setattr("dflash_batch.runner.jobs._probe_write", read_only)
    err = refused(capsys, "run", data, "-o", tmp_path / "out")
    assert f"output_dir {tmp_path / 'out'}: cannot write there (Read-only file system)" in err
    assert not job_records(home)


def test_results_out_to_a_fifo_nobody_reads_is_refused_at_once(tmp_path, home, fake_models):
    data = write_jsonl(tmp_path / "ok.jsonl", [PROMPT])
    job = cli("run", data, "-q", "--json", home=home, check=True)
    job_id = json.loads(job.stdout)["id"]
    os.mkfifo(tmp_path / "fifo")
    for fmt in ("jsonl", "openai", "parquet"):
        out = cli(
            "results", job_id, "--format", fmt, "--out", tmp_path / "fifo", home=home, timeout=120
        )
        assert out.returncode == 2 and "a FIFO that nothing reads" in out.stderr, out.stderr
    assert (tmp_path / "fifo").is_fifo()


@pytest.mark.parametrize("body, key", [
    ("chat_template_kwargs: {x: !!set {a, b}}", "chat_template_kwargs"),
    ("chat_template_kwargs: {x: !!binary aGk=}", "chat_template_kwargs"),
    ("chat_template_kwargs: {1: a}", "chat_template_kwargs"),
    ("sampling: {response_format: {type: json_object, x: !!set {a}}}", "response_format"),
])  # fmt: skip
def test_spec_values_that_are_not_json_are_refused(tmp_path, home, capsys, body, key):
    write_jsonl(tmp_path / "ok.jsonl", [PROMPT])
    (tmp_path / "job.yaml").write_text(f"input: ok.jsonl\n{body}\n")
    err = refused(capsys, "submit", tmp_path / "job.yaml")
    assert f"job.yaml: '{key}' must hold only JSON values" in err
    assert not job_records(home)


FLAGS_64 = ["--chunk-size", "--max-tokens", "--block-size", "--retries", "--top-k"]


@pytest.mark.parametrize("flag", FLAGS_64)
def test_integers_beyond_64_bits_are_refused(tmp_path, home, capsys, flag):
    data = write_jsonl(tmp_path / "ok.jsonl", [PROMPT])
    err = refused(capsys, "submit", data, flag, 2**64)
    assert f"'{flag[2:].replace('-', '_')}' must be at most 2**64 - 1" in err
    assert not job_records(home)
