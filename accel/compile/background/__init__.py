"""Cold compiles off the critical path: a child process compiles block kinds while their blocks run eagerly, and
saves whole what ComfyUI's process compiled itself (choose="always compiled", background=false), after the call.

- state.py: where each kind stands (a closed set of states, moved only through its `KindBackground`);
- skeleton.py: what is sent, a block's structure and tensor layouts, never the user's weights;
- decision.py: whether a kind's first cold compile goes to a child, or it loads from the cache instead; outside
  that decision, whether a kind finds precompiled functions to load and whether what compiles here is saved;
- capture.py: what a child compiles, taken during an eager call (a block's skeleton, its calls' input layouts);
- parent.py: the jobs in ComfyUI's process, one at a time: launched, queued or held, polled, waited for (`BACKGROUND`);
- job_results.py: an ended job's results read and handed back to its kinds, its record for the stats;
- worker.py: the child process that waits for the next job until it has been idle a while, and one job sent to it;
- worker_keeper.py: which child a job goes to, and when the waiting one is retired (its idle timer);
- job_folders.py: the jobs' and children's folders, and the sweep of those whose process is gone;
- idle_gate.py: on a CPU with few cores (hold_until_idle), held work starts at this process's next idle
  moment (`IDLE_GATE`);
- cpu_checks.py: inductor's per-process CPU checks in a thread, before kinds found in the cache load;
- loader.py: kinds' precompiled functions loaded at an idle moment, not in a prompt;
- activity.py: the pack's own work running now (a child, the CPU checks), so no timing is taken beside it.

This package is the parent's side only, in ComfyUI's process. The child's side (`python -m accel compile-worker DIR`:
its loop, what it compiles and saves, the batch twin) is compile/child/, which nothing here imports.
"""
from .activity import ACTIVITY, DroppedSamples
from .capture import Capture
from .idle_gate import IDLE_GATE, hold_until_idle
from .parent import BACKGROUND, BackgroundCompiler
from .skeleton import CaptureError, dump_skeleton, load_skeleton
from .state import SETTLED_STATES, WAITING_STATES, BackgroundState, KindBackground

__all__ = ["ACTIVITY", "DroppedSamples", "BACKGROUND", "BackgroundCompiler", "Capture", "IDLE_GATE",
           "hold_until_idle", "CaptureError", "dump_skeleton", "load_skeleton",
           "BackgroundState", "KindBackground", "SETTLED_STATES", "WAITING_STATES"]
