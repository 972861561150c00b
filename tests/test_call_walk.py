"""The walk of a warm compiled call (issue #71's target, accel/compile/README.md): `python -m tools.call_walk`,
the command the README gives, run as a user runs it, on the generated SD1.5 UNet with ComfyUI's own loader and
sampler, on each compiled path: Dynamo's graphs compiled in the process, and the same graphs saved whole by the
background child and loaded (as a restart or a fleet worker serves them). Every block call takes one walk of at
most 6 engine files, none entered twice: the route is bound once per call (dispatch.RUNNERS), the per-call answer
comes from one function (blocks.BlockSite.compiled_call), and a warm call asks the kind's shapes nothing more."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tools.comfy_env import ROOT

PATH_FILES = {"dynamo": {"compile/dynamo_runner.py", "compile/entry_function.py"},
              "precompiled": {"compile/precompiled_runner.py", "compile/precompiled.py"}}


@pytest.mark.parametrize("path", sorted(PATH_FILES))
def test_a_warm_compiled_block_call_crosses_at_most_six_files_none_twice(path):
    done = subprocess.run([sys.executable, "-m", "tools.call_walk", "--json", "--path", path], capture_output=True,
                          text=True, cwd=ROOT, env=os.environ.copy(), timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    walk = json.loads(done.stdout)
    assert walk["block_calls"] >= 12 and walk["block_walks"] == 1, walk  # every block call the same walk
    assert walk["block_files"] <= 6 and walk["block_files_entered_twice"] == [], walk
    # the runner and the answer are where the README says
    assert {"compile/dispatch.py", "compile/blocks.py", "compile/kinds.py"} <= set(walk["block_entries"]), walk
    assert PATH_FILES[path] <= set(walk["block_entries"]), walk  # the path asked for, and no other
    assert not PATH_FILES[({*PATH_FILES} - {path}).pop()] & set(walk["block_entries"]), walk
