"""Ctrl-C during a capture, a replay, a ``store=`` capture, a dataset job and a save (issue 28).

Each test runs ``tests/interrupt_driver.py`` in a child process, which presses Ctrl-C on itself
(SIGINT) at a chosen point of one operation, or has the parent press it once the child says it is
running; the child catches ``KeyboardInterrupt``, checks what the interrupt left and prints it as
JSON. The model must be exactly as it was (no hook, no forward wrapper, no function mode; same
parameters and training flag), every artefact on disk complete, absent, or refused on load with a
typed error, and the same operation must then run and give what a plain forward hook reads.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys

import pytest
import torch
from conftest import TINY_GPT2_IDS, assert_model_clean, build_tiny_gpt2, hook_state

import torchlens as tl

DRIVER = pathlib.Path(__file__).with_name("interrupt_driver.py")
ENV = dict(os.environ, TORCHLENS_PROGRESS="0")
CLEAN = {"interrupted": True, "hooks_left": [], "params_equal": True, "training": False, "globals_left": [],
         "debris": [], "again": "ok"}


def report_of(stdout: str, stderr: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    assert lines, stdout[-2000:] + stderr[-3000:]
    return json.loads(lines[-1])


def assert_clean(report: dict) -> None:
    found = {key: report.get(key) for key in CLEAN}
    assert found == CLEAN, report


# (operation@point, what its artefact then is): see the driver's docstring for the points
SCENARIOS = {
    "trace@layer:0": "none", "trace@layer:1": "none",
    "trace@enter:2": "none",  # while the capture puts its forward wrappers on
    "extract@layer:0": "none",  # the hooks engine
    "fork_model@layer:1": "none",  # a fork re-executed with model=
    "fork@op:1": "none", "fork@op:5": "none",  # replay
    "store@layer:0": "absent", "store@layer:1": "absent",
    "dataset@call:3": "refused:DatasetFormatError", "dataset@write:2": "refused:DatasetFormatError",
    "save_trace@tensors": "absent", "save_trace@manifest": "absent",
    "save_trace@swap": "complete:6 tokens",  # the overwrite finishes: never neither save in place
    "save_recipe@manifest": "absent",
    "save_recipe@swap": "complete:[\"module('transformer.h.0')\"]",
    # while the capture takes its wrappers off (last: where that leaves wrappers behind, as it did,
    # a wrapper's id reused by a later scenario would blur that scenario's own report)
    "trace@exit:1": "none", "trace@exit:5": "none", "store@exit:3": "absent",
}


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict[str, dict]:
    """Every scenario, run by one child process (one start of torch and transformers for all)."""
    work = tmp_path_factory.mktemp("interrupts")
    proc = subprocess.run([sys.executable, str(DRIVER), str(work), *SCENARIOS], capture_output=True, text=True,
                          timeout=900, env=ENV)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    found = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {r["scenario"]: r for r in found}


def check(reports: dict[str, dict], scenario: str) -> dict:
    report = reports[scenario]
    assert_clean(report)
    assert report["artefact"] == SCENARIOS[scenario]
    return report


@pytest.mark.parametrize("scenario", [s for s in SCENARIOS if s.split("@")[0] in ("trace", "extract", "fork_model")])
def test_ctrl_c_during_a_capture_leaves_the_model_as_it_was(reports, scenario):
    check(reports, scenario)


@pytest.mark.parametrize("scenario", ["fork@op:1", "fork@op:5"])
def test_ctrl_c_during_a_replay_leaves_the_fork_as_it_was(reports, scenario):
    report = check(reports, scenario)
    assert report["fork_output_after"] == report["fork_output_before"]


@pytest.mark.parametrize("scenario", [s for s in SCENARIOS if s.startswith("store@")])
def test_ctrl_c_during_a_store_capture_takes_back_its_shards(reports, scenario):
    check(reports, scenario)  # "again": the same store= path then takes a whole trace


@pytest.mark.parametrize("scenario", [s for s in SCENARIOS if s.startswith("dataset@")])
def test_ctrl_c_during_a_dataset_job_leaves_it_resumable(reports, scenario):
    report = check(reports, scenario)  # "again": the rerun resumes, and its files equal an uninterrupted job's
    assert "manifest.json" in report["files"]
    assert not [name for name in report["files"] if ".tmp-" in name]  # no half-written shard left


@pytest.mark.parametrize("scenario", [s for s in SCENARIOS if s.startswith("save_")])
def test_ctrl_c_during_a_save_leaves_a_whole_save_or_none(reports, scenario):
    check(reports, scenario)


@pytest.mark.parametrize(("operation", "artefacts"), [
    ("trace", {"none"}),
    ("store", {"absent", "empty", "complete"}),  # empty: made, Ctrl-C before the capture began; reusable
    ("dataset", {"absent", "refused:DatasetFormatError", "complete"}),  # absent: before the job made it
])
def test_ctrl_c_from_the_parent_process(operation, artefacts, tmp_path):
    """The parent presses Ctrl-C once the child says ``ready`` (it then repeats the operation until
    interrupted): wherever the signal lands, the same guarantees hold."""
    proc = subprocess.Popen([sys.executable, str(DRIVER), str(tmp_path), f"{operation}@parent"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        for line in proc.stdout:
            if line.strip() == "ready":
                break
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stdout[-2000:] + stderr[-3000:]
    report = report_of(stdout, stderr)
    assert_clean(report)
    assert report["artefact"] in artefacts


# -- in this process --------------------------------------------------------------------------------


@pytest.fixture
def ctrl_c():
    """SIGINT handled as an interactive Python does (a shell starts background jobs with it ignored)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_hold_interrupts_raises_ctrl_c_when_the_block_ends(ctrl_c):
    from torchlens._interrupts import HoldInterrupts

    done = []
    with pytest.raises(KeyboardInterrupt):
        with HoldInterrupts():
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):  # many bytecodes: Python would have raised by now
                done.append(1)
            done.append("end")
    assert done[-1] == "end"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_attached_exits_what_it_entered_when_ctrl_c_lands_on_entry(ctrl_c):
    from torchlens._interrupts import Attached

    log = []

    class Manager:
        def __init__(self, name, press=False):
            self.name, self.press = name, press

        def __enter__(self):
            log.append(f"enter {self.name}")
            if self.press:
                os.kill(os.getpid(), signal.SIGINT)

        def __exit__(self, *exc):
            log.append(f"exit {self.name}")

    with pytest.raises(KeyboardInterrupt):
        with Attached(Manager("a", press=True), Manager("b")):
            log.append("body")
    assert log == ["enter a", "enter b", "exit b", "exit a"]


class Broken(torch.nn.Module):
    """Block 1's MLP activation, raising: the forward fails half-way."""

    def forward(self, x):
        raise RuntimeError("the forward failed")


def test_a_store_capture_whose_forward_raises_leaves_no_shards(tmp_path):
    model = build_tiny_gpt2()
    model.transformer.h[1].mlp.act = Broken()
    before = hook_state(model)
    with pytest.raises(RuntimeError, match="the forward failed"):
        tl.trace(model, torch.tensor(TINY_GPT2_IDS), store=tmp_path / "store")
    assert_model_clean(model, before)
    assert not (tmp_path / "store").exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(RuntimeError, match="the forward failed"):
        tl.trace(model, torch.tensor(TINY_GPT2_IDS), store=tmp_path / "empty")
    assert list((tmp_path / "empty").iterdir()) == []  # a directory it did not make stays, empty
