"""The hardware policy over a table of simulated devices, the real probe here, and the env switches."""
from __future__ import annotations

import pytest

from compile_helpers import SMALL, assert_close_to_eager, dynamo_frames, sample


@pytest.fixture(scope="module")
def hardware(accel_pack):
    return accel_pack.accel.hardware


def cuda(hardware, cap, name, malloc_async=False):
    return hardware.DeviceProbe("cuda", name, cap, triton=True, c_compiler=True,
                                cuda_malloc_async=malloc_async)


# feature -> allowed, per simulated device
TABLE = {
    "cpu": dict(compile=True, cuda_graphs=False, max_autotune=True),
    "sm_70": dict(compile=True, cuda_graphs=True, max_autotune=False),
    "sm_75": dict(compile=True, cuda_graphs=True, max_autotune=False),
    "sm_80": dict(compile=True, cuda_graphs=True, max_autotune=True),
    "sm_89": dict(compile=True, cuda_graphs=True, max_autotune=True),
    "sm_90": dict(compile=True, cuda_graphs=True, max_autotune=True),
    "mps": dict(compile=False, cuda_graphs=False, max_autotune=False),
}


def simulated(hardware, name):
    if name == "cpu":
        return hardware.DeviceProbe("cpu", "cpu", None, c_compiler=True)
    if name == "mps":
        return hardware.DeviceProbe("mps", "Apple M2")
    cap = (int(name[3]), int(name[4]))
    return cuda(hardware, cap, {"sm_70": "Tesla V100", "sm_75": "Tesla T4", "sm_80": "A100", "sm_89": "RTX 4090",
                                "sm_90": "H100"}[name])


@pytest.mark.parametrize("device", sorted(TABLE))
def test_policy_table(hardware, device):
    policy = hardware.decide(simulated(hardware, device), env={})
    got = {feature: policy.allows(feature) for feature in TABLE[device]}
    assert got == TABLE[device], {f: policy.explain(f) for f in got}
    for feature, decision in policy.decisions.items():
        if not decision.allowed:  # every refusal says why and names the switch
            assert hardware.SWITCHES[feature] in decision.reason


def test_cuda_malloc_async_refuses_cuda_graphs_with_the_fix(hardware):
    policy = hardware.decide(cuda(hardware, (8, 9), "RTX 4090", malloc_async=True), env={})
    assert not policy.allows("cuda_graphs") and "--disable-cuda-malloc" in policy.explain("cuda_graphs")


def test_env_switch_turns_each_feature_off(hardware):
    for feature, switch in hardware.SWITCHES.items():
        for on in ("1", "true", "yes"):
            policy = hardware.decide(simulated(hardware, "sm_90"), env={switch: on})
            assert not policy.allows(feature) and f"{switch}={on}" in policy.explain(feature)
        # as a docker-compose file writes "off" (before, any value but "" and "0" turned the feature off)
        for off in ("", "0", "false", "False", "no", "off"):
            assert hardware.decide(simulated(hardware, "sm_90"), env={switch: off}).allows(feature), (switch, off)


def test_real_probe_here(hardware):
    found = hardware.probe()
    policy = hardware.decide(found, env={})
    assert found.device_type in ("cpu", "cuda")
    assert policy.allows("compile") == (found.c_compiler if found.device_type == "cpu" else found.triton)


def test_disable_compile_switch_runs_eagerly_and_correctly(accel_pack, comfy_dir, monkeypatch):
    import nodes

    engine = accel_pack.accel.compile
    (model,) = nodes.UNETLoader().load_unet(SMALL, "default")
    eager = sample(model, size=8, steps=2)
    monkeypatch.setenv("ACCEL_DISABLE_COMPILE", "1")
    frames = dynamo_frames()
    out = sample(engine.compile_model(model, engine.CompileOptions(choose="always compiled")), size=8, steps=2)
    assert dynamo_frames() == frames
    assert_close_to_eager(out, eager, "compile switched off")


# What a background child does to keep the sampler's CPU, where the platform allows it (Linux's idle scheduling
# class, a niceness elsewhere, nothing on Windows): each case in a process forked for it (the priority it sets
# cannot be undone), from one that imported the child's module once.
CHILD_PRIORITY = """
import json, logging, os, sys
logging.basicConfig(level=logging.WARNING, format="%(message)s")
from accel.compile.child import serve as child
nice = os.nice
for case, value in json.loads(sys.argv[1]):
    sys.stdout.flush(); sys.stderr.flush()
    if os.fork() == 0:
        os.environ["ACCEL_BACKGROUND_NICE"] = value
        if case == "windows":  # neither the idle class nor os.nice, as on Windows
            del os.SCHED_IDLE, os.nice
        print(case, "said:", end=" ", flush=True)
        child._lower_priority()
        print("policy", os.sched_getscheduler(0), "nice", nice(0), flush=True)
        os._exit(0)
    os.wait()
"""
PRIORITY_CASES = {"unset": ("", "policy 5 nice 0"), "a word": ("ten", "policy 5 nice 0"),
                  "a number": ("7", "policy 0 nice 7"), "windows": ("", "policy 0 nice 0")}


def test_the_background_childs_priority_and_its_setting():
    """ACCEL_BACKGROUND_NICE unset or empty: the idle scheduling class (SCHED_IDLE, 5); a whole number: that
    niceness; anything else is said in the log and the idle class kept (before, "ten" or an empty value left the
    child at full priority, unseen). Without either (Windows), the child starts at its normal priority (before,
    os.nice's absence stopped every background compile there)."""
    import json
    import subprocess
    import sys

    from tools.comfy_env import ROOT

    cases = [(case, value) for case, (value, _) in PRIORITY_CASES.items()]
    proc = subprocess.run([sys.executable, "-c", CHILD_PRIORITY, json.dumps(cases)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = dict(line.split(" said: ", 1) for line in proc.stdout.splitlines())
    assert seen == {case: expected for case, (_, expected) in PRIORITY_CASES.items()}, (proc.stdout, proc.stderr)
    assert proc.stderr.count("is not a whole number") == 1 and "'ten'" in proc.stderr, proc.stderr


def test_the_panels_thread_report_needs_no_proc_nor_sysconf(accel_pack, monkeypatch):
    """GET /accel/stats lists each thread's CPU time from /proc; where there is none (Windows, which has no
    os.sysconf either) it lists none. Before, os.sysconf was called first: the route answered 500 on Windows and
    the Accel panel showed nothing."""
    import importlib
    import os

    diagnostics = importlib.import_module(accel_pack.__name__ + ".accel.diagnostics")
    assert diagnostics.thread_times(os.getpid())  # Linux: this process's threads
    monkeypatch.delattr(os, "sysconf")
    assert diagnostics.thread_times(2**22 + 12345) == []  # no /proc entry: as on Windows


def test_the_precompiled_switch_takes_the_off_values_of_every_switch(accel_pack, monkeypatch):
    """ACCEL_PRECOMPILED is on unless set to an off value, read as every switch of the pack reads them (0, false,
    no, off, in any case; empty is unset). Before, only "0" and the empty value turned it off."""
    import importlib

    precompiled = importlib.import_module(accel_pack.__name__ + ".accel.compile.precompiled")
    for value in ("0", "false", "OFF", " no "):
        monkeypatch.setenv("ACCEL_PRECOMPILED", value)
        assert precompiled.unavailable().startswith("off (ACCEL_PRECOMPILED="), value
    for value in ("", "1", "yes"):
        monkeypatch.setenv("ACCEL_PRECOMPILED", value)
        assert not precompiled.unavailable().startswith("off"), value
