"""``lp-lightning st`` options: usage errors, ``--reuse_runs``, and stopping it (Ctrl-C, SIGTERM).

The usage errors and the re-report run in this process and start no ``fit`` (exit 2 comes before
any run; a reused run is read, not run). The signal tests start a real ``lp-lightning st`` and stop
it while its first ``fit`` runs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from lp_lightning.st.cases import STSettings, build_runs
from lp_lightning.cli import main  # the dispatcher hands st the fit parser and entry point
from lp_lightning.st.runner import KILL_GRACE_S, execute_run, run_config

REPO = Path(__file__).resolve().parents[2]
QUICK = ["--skip", "[illegal, numerics]"]


def _usage_error(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(["st", *argv])
    assert exit_info.value.code == 2
    return " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize(("argv", "words"), [
    (["--rows", "[]"], "--rows is empty; name at least one of ['Q3-01'"),
    (["--cases", "[]"], "--cases is empty; name at least one of ['bf16', 'mxfp8', 'hif8_current']"),
    (["--rows", "[Q3-04, Q3-09]", "--cases", "[mxfp8]"],
     "--cases ['mxfp8'] leaves out cases these --rows read: Q3-04 (hif8_current), Q3-09 (bf16, hif8_current)"),
    (["--steady_steps", "10"], "--steady_steps 10 is below --required_steps 20"),
    (["--required_steps", "5", "--steady_steps", "5"], "--required_steps 5 is below the design spec §17.2/§17.4 minimum 20"),
    (["--devices", "0"], "--devices 0 must be >= 1"),
    (["--devices", "-1"], "--devices -1 must be >= 1"),
])
def test_usage_errors_exit_2_naming_the_option(capsys, tmp_path, argv, words):
    message = _usage_error(capsys, "--out", str(tmp_path / "st"), *argv)
    assert words in message and "Traceback" not in message
    assert not (tmp_path / "st").exists()  # nothing ran, nothing was written


def test_reduced_allows_a_smoke_run_and_out_must_be_a_folder(capsys, tmp_path):
    file = tmp_path / "st"
    file.write_text("")
    assert f"--out {str(file)!r} is a file; name a folder" in _usage_error(capsys, "--out", str(file))
    # --reduced lifts the step and case rules (here the next rule stops it: no run to reuse)
    message = _usage_error(capsys, "--out", str(tmp_path / "smoke"), "--reduced", "true", "--required_steps", "3",
                           "--steady_steps", "2", "--rows", "[Q3-04]", "--cases", "[mxfp8]", "--reuse_runs", "true",
                           *QUICK)
    assert "--reuse_runs true: no run of the selected rows under" in message


def _fake_run(out: Path, name: str, settings: STSettings, user_config: str = "# embedded default\n{}\n") -> Path:
    spec = next(s for s in build_runs(settings, reshard_after_forward=True) if s.name == name)
    folder = out / "runs" / name
    folder.mkdir(parents=True)
    (folder / "run.yaml").write_text(yaml.safe_dump(run_config(spec, folder, settings)))
    (folder / "user_config.yaml").write_text(user_config)
    (folder / "run_summary.json").write_text(json.dumps({"steps": 5, "losses": [3.0] * 5, "grad_norms": [1.0] * 5}))
    return folder


def test_reuse_runs_reads_matching_runs_logs_and_marks_them(capsys, tmp_path):
    out = tmp_path / "st"
    for case in ("mxfp8", "hif8_current"):
        _fake_run(out, f"accum/{case}", STSettings())
    code = main(["st", "--out", str(out), "--rows", "[Q3-07]", "--reuse_runs", "true", *QUICK])
    err = capsys.readouterr().err
    assert code == 1  # the fake runs carry no refresh records: Q3-07 fails, but nothing was run again
    assert f"accum/mxfp8: reused (--reuse_runs) from {out / 'runs' / 'accum' / 'mxfp8'}" in err and "running" not in err
    report = json.loads((out / "report.json").read_text())
    assert [(r["name"], r["reused"]) for r in report["runs"]] == [("accum/mxfp8", True), ("accum/hif8_current", True)]
    assert not (out / "runs" / "accum" / "mxfp8" / "console.log").exists()


def test_reuse_runs_refuses_runs_made_with_other_options(capsys, tmp_path):
    out = tmp_path / "st"
    _fake_run(out, "accum/mxfp8", STSettings())
    _fake_run(out, "accum/hif8_current", STSettings(), user_config="model:\n  lr: 0.1\n")
    message = _usage_error(capsys, "--out", str(out), "--rows", "[Q3-07]", "--reuse_runs", "true", "--variant_steps",
                           "4", *QUICK)
    assert "runs/accum/mxfp8 was made with other options, its run.yaml differs at trainer.max_steps: 5 then, 4 now" \
        in message
    message = _usage_error(capsys, "--out", str(out), "--rows", "[Q3-07]", "--reuse_runs", "true", *QUICK)
    assert "runs/accum/hif8_current was made with other options, its user config differs at model.lr: 0.1 then, " \
           "None now" in message
    (out / "runs" / "accum" / "mxfp8" / "user_config.yaml").unlink()  # a run of an older lp-lightning st
    message = _usage_error(capsys, "--out", str(out), "--rows", "[Q3-07]", "--cases", "[mxfp8]", "--reduced", "true",
                           "--reuse_runs", "true", *QUICK)
    assert "runs/accum/mxfp8" in message and "user_config.yaml is missing or unreadable" in message


def _processes_naming(text: str) -> list[int]:
    """Live processes whose command line contains ``text`` (zombies have an empty one)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="reads /proc")
def test_a_run_past_its_timeout_is_stopped_with_its_process_group(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    spec = next(s for s in build_runs(STSettings(), reshard_after_forward=True) if s.name == "main/bf16")
    started = time.monotonic()
    result = execute_run(spec, tmp_path, user_config=None, settings=STSettings(), timeout_s=3.0)
    assert time.monotonic() - started < 3.0 + KILL_GRACE_S + 5
    assert not result.ok and result.exit_code is None and result.error.startswith("timed out")
    assert (tmp_path / "runs" / "main" / "bf16" / "user_config.yaml").read_text().startswith("# embedded default")
    assert _processes_naming(str(tmp_path / "runs")) == []


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="reads /proc")
@pytest.mark.parametrize(("sig", "code", "line", "ranks"), [
    (signal.SIGTERM, 143, "lp-lightning st: stopped by SIGTERM", 2),
    (signal.SIGINT, 130, "lp-lightning st: interrupted (Ctrl-C)", 1),
])
def test_a_signal_stops_st_and_every_fit_process_it_started(tmp_path, sig, code, line, ranks):
    out = tmp_path / "st"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "lp_lightning.cli", "st", "--out", str(out), "--rows", "[Q3-01]", "--cases",
               "[bf16]", "--devices", "2", *QUICK]
    # A shell started without job control (CI runners, `cmd &`) gives its background jobs SIGINT
    # ignored, and a Python started that way keeps ignoring it: give st the default, as a terminal would.
    proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    run = str(out / "runs" / "main" / "bf16")
    deadline = time.monotonic() + 240
    while len(_processes_naming(run)) < ranks:  # SIGTERM: wait for the launcher and the rank it started
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.5)
    started = time.monotonic()
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == code, stderr[-3000:]
    assert time.monotonic() - started < KILL_GRACE_S + 15
    assert stderr.strip().splitlines()[-1].startswith(line) and "Traceback" not in stderr
    assert "Seed set to" not in stderr + stdout  # st's own process does not seed (its fit runs do)
    time.sleep(0.5)
    assert _processes_naming(run) == []


def test_a_usage_error_is_its_message_and_a_pointer_to_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["st", "--bogus", "1"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["lp-lightning st: error: unrecognized arguments: --bogus 1",
                   "lp-lightning st --help lists every option."]


def test_every_bad_option_is_reported_at_once(capsys, tmp_path):
    message = _usage_error(capsys, "--out", str(tmp_path / "st"), "--rows", "[]", "--skip", "[nope]",
                           "--accumulation", "1", "--variant_steps", "0")
    for words in ("--rows is empty", "--skip ['nope']: unknown part", "accumulation=1", "--variant_steps 0"):
        assert words in message, words


def _yaml_on_npu(backend: str):
    """The fit config parser with the YAML's accelerator set to npu and its backend to ``backend`` (this host has
    no NPU; ``st`` reads both from the parsed YAML and nothing runs before the check)."""
    from lp_lightning.cli.fit import parse_config

    def parse(argv):
        parsed = parse_config(argv)
        parsed.trainer.accelerator, parsed.backend = "npu", backend
        return parsed

    return parse


def test_an_npu_target_without_torch_npu_stops_st_before_its_runs(capsys, tmp_path, monkeypatch):
    from lp_lightning.st.main import st_main

    monkeypatch.setitem(sys.modules, "torch_npu", None)  # not installed
    out = tmp_path / "st"
    with pytest.raises(SystemExit) as exit_info:  # numerics skipped: the runs need the device all the same
        st_main(["--out", str(out), "--rows", "[Q3-01]", "--cases", "[bf16]", "--reduced", "true", *QUICK],
                parse_config=_yaml_on_npu("auto"), fit_main=main)
    assert exit_info.value.code == 2 and not out.exists()
    assert "st on npu:0 (trainer.accelerator npu) needs torch_npu" in " ".join(capsys.readouterr().err.split())


def test_the_emulated_backend_on_the_npu_stops_st_unless_allowed(capsys, tmp_path):
    from lp_lightning.st.main import st_main

    out = tmp_path / "st"
    argv = ["--out", str(out), "--rows", "[Q3-10]", "--reduced", "true", *QUICK]
    with pytest.raises(SystemExit) as exit_info:
        st_main(argv, parse_config=_yaml_on_npu("emulated"), fit_main=main)
    assert exit_info.value.code == 2
    message = " ".join(capsys.readouterr().err.split())
    assert "backend: emulated) on the npu accelerator" in message and "--allow_emulated true" in message
    assert not out.exists()  # stopped before any run
    # Allowed on purpose: it goes on, and the report's meta says what ran where.
    code = st_main([*argv, "--allow_emulated", "true"], parse_config=_yaml_on_npu("emulated"), fit_main=main)
    assert code in (0, 1)  # Q3-10 fails: its part was skipped
    report = json.loads((out / "report.json").read_text())
    target = report["target"]
    assert (target["accelerator"], target["backend"], target["emulated_on_npu"]) == ("npu", "emulated", True)
    assert '"emulated_on_npu": true' in (out / "report.md").read_text()
    # backend auto on the npu accelerator is the npu backend: no stop.
    code = st_main(["--out", str(tmp_path / "auto"), "--rows", "[Q3-10]", "--reduced", "true", *QUICK],
                   parse_config=_yaml_on_npu("auto"), fit_main=main)
    assert code in (0, 1) and json.loads((tmp_path / "auto" / "report.json").read_text())["target"]["emulated_on_npu"] is False
