"""The pack's environment variables, read one way for all, and the one list of them (SETTINGS). Numbers: unset gives
the default; a value that is not a finite number (inf only where a setting takes it) is logged with the variable's
name and the default is used (a typo in a server's environment must never stop a prompt, and must not pass unseen).
Switches (ACCEL_DISABLE_*): on for any value but unset, empty, 0, false, no or off, in any case (a docker-compose
file's `false` turned a switch on).

Every ACCEL_ name the pack's code reads is in SETTINGS, and only those (tests/test_env_switches.py checks both
ways); README.md's table of them is rendered from it: `python -m tools.env_table --write`. Importing this module
needs neither torch nor ComfyUI."""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

log = logging.getLogger("comfyui_accel")


def env_float(name: str, default: float, allow_inf: bool = False) -> float:
    """The variable's number; with `allow_inf`, `inf` too (a size with no cap)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        log.warning("[Accel] %s=%r is not a number; using %s", name, raw, default)
        return default
    if math.isfinite(value) or (allow_inf and value == math.inf):
        return value
    log.warning("[Accel] %s=%r is not a finite number; using %s", name, raw, default)
    return default


OFF_VALUES = ("", "0", "false", "no", "off")


def env_switch(name: str, env=None) -> str | None:
    """The switch's value when it is on (for a message to quote), else None."""
    raw = (os.environ if env is None else env).get(name, "").strip()
    return None if raw.lower() in OFF_VALUES else raw


KINDS = ("switch", "number", "text")
README = "README.md"


@dataclass(frozen=True)
class Setting:
    """One environment variable the pack reads. `kind`: "switch" (off for 0, false, no or off in any case, on for any
    other value, its default when unset or empty), "number" or "text". `default` (as users read it) and `does` (one
    sentence, Markdown) are what README.md's table shows. `doc`: where users read about it, README (its table, made
    by tools/env_table.py), or a page of docs/ for a setting tuned there (the page names it), or "" for an internal
    or test-only variable."""
    name: str
    kind: str
    default: str
    does: str
    doc: str = README

    def __post_init__(self):
        if self.kind not in KINDS or not self.name.startswith("ACCEL_"):
            raise ValueError(f"{self.name}: kind {self.kind!r} is not one of {', '.join(KINDS)}, or no ACCEL_ name")

    @property
    def user_facing(self) -> bool:
        return bool(self.doc)

    @property
    def in_readme(self) -> bool:
        return self.doc == README


# Where each is read: the module named in the comment above it (by its constant there, where it has one).
SETTINGS = (
    # hardware.py SWITCHES: each turns one feature of the hardware policy off
    Setting("ACCEL_DISABLE_COMPILE", "switch", "off",
            "Compile Model and Compile VAE compile nothing and pass the model through (to skip a node in one "
            "workflow instead, bypass it: Ctrl+B)."),
    Setting("ACCEL_DISABLE_BACKGROUND_COMPILE", "switch", "off",
            "Cold compiles run in the prompt's path instead of in a background process."),
    Setting("ACCEL_DISABLE_CUDA_GRAPHS", "switch", "off",
            "No CUDA graphs: `mode=reduce-overhead` compiles as `default`, and `ACCEL_CUDA_GRAPHS` replays none."),
    Setting("ACCEL_DISABLE_MAX_AUTOTUNE", "switch", "off",
            "`mode=max-autotune-no-cudagraphs` compiles as `default`."),
    Setting("ACCEL_DISABLE_SDPA_IN_COMPILED_BLOCKS", "switch", "off",
            "Compiled blocks keep ComfyUI's sub-quadratic or split attention, which PyTorch's SDPA (the same maths, "
            "fewer graph breaks) replaces there otherwise."),
    # cache/remote_torch_entries.py TORCH_CACHES_OFF_ENV
    Setting("ACCEL_DISABLE_REMOTE_TORCH_CACHE", "switch", "off",
            "With a remote cache ([docs/cache.md](docs/cache.md)), torch's own remote caches stay off: only the "
            "pack's artifacts travel."),
    # compile/child/batch_twin.py SWITCH
    Setting("ACCEL_DISABLE_BATCH_TWIN", "switch", "off",
            "No second graph for larger batches beside a kind's dynamic one made at a batch of 1."),
    # compile/precompiled.py ENV
    Setting("ACCEL_PRECOMPILED", "switch", "on",
            "Compiled blocks load as saved whole functions where torch can; off (`0`), through torch's own caches "
            "instead."),
    # compile/background/decision.py SAVE_ENV
    Setting("ACCEL_SAVE_COMPILES", "switch", "on",
            "Graphs compiled in ComfyUI's process (`choose=always compiled`, `background=false`, or a kind it "
            "compiles itself) are saved whole afterwards by a background child, as the background compile saves "
            "its own, so a restart or a fleet worker loads them instead of tracing them; off (`0`), they are left "
            "to torch's own caches.", doc="docs/compile_model.md"),
    # compile/options.py CUDA_GRAPHS_SWITCH
    Setting("ACCEL_CUDA_GRAPHS", "switch", "off",
            "Experimental, CUDA only: Compile Model replays each compiled block's call from a CUDA graph (fewer "
            "kernel launches), kept with `choose=auto` only where whole steps measure faster; a partially loaded "
            "model, or weights that keep moving (LoRA changes, Swap Weights), runs the plain compiled blocks, the "
            "status says whether graphs are on and why, and ComfyUI's default cudaMallocAsync allocator keeps them "
            "off (`--disable-cuda-malloc` allows them) ([docs/cuda_graphs.md](docs/cuda_graphs.md))."),
    # malloc/tune.py SWITCH
    Setting("ACCEL_MALLOC_TUNE", "switch", "off",
            "Raises glibc's mmap threshold to 32 MiB, its trim threshold to 256 MiB and its top pad to 64 MiB when "
            "Compile Model is first applied, never when `MALLOC_*` or `GLIBC_TUNABLES` is set or tcmalloc, jemalloc "
            "or mimalloc is preloaded (off by default until a GPU run confirms the process tax's cause: "
            "[docs/process_tax.md](docs/process_tax.md))."),
    # cache/location.py ENV_VAR
    Setting("ACCEL_CACHE_DIR", "text", "`accel_cache/` in ComfyUI's directory",
            "Moves the compile cache (below)."),
    # cache/eviction.py MAX_SIZE_ENV
    Setting("ACCEL_CACHE_MAX_GB", "number", "10",
            "The compile cache's size cap in GB (`inf`: no cap); least recently used environments and block kinds go "
            "first."),
    # precompile.py
    Setting("ACCEL_EXTRA_MODEL_PATHS", "text", "unset",
            "More `extra_model_paths.yaml`-style files that `python -m accel precompile` loads, separated by `:` "
            "(`;` on Windows)."),
    # cache/remote_connection.py URL_ENV, KEY_ENV: a fleet's shared store
    Setting("ACCEL_REMOTE_CACHE", "text", "unset",
            "A Redis URL (`redis://host:port/db`, `rediss://` for TLS) through which a fleet of workers shares the "
            "compile cache.", doc="docs/cache.md"),
    Setting("ACCEL_REMOTE_CACHE_KEY", "text", "unset",
            "The secret that signs what the Redis store holds, the same on every worker, at least 16 characters; "
            "without it the remote cache stays off.", doc="docs/cache.md"),
    # compile/background/worker.py IDLE_ENV
    Setting("ACCEL_BACKGROUND_IDLE_SECONDS", "number", "600 on a CPU, else 0",
            "How long the background child waits for a next job before it ends (0: a new child per job).",
            doc="docs/compile_model.md"),
    # compile/background/idle_gate.py AT_ONCE_ENV, MAX_WAIT_ENV
    Setting("ACCEL_BACKGROUND_AT_ONCE", "switch", "off",
            "A background compile starts at once, never held for an idle moment of ComfyUI (as on a GPU or a CPU "
            "of more than 4 cores).", doc="docs/compile_model.md"),
    Setting("ACCEL_BACKGROUND_IDLE_WAIT", "number", "20",
            "On a CPU of at most 4 cores, the longest a background compile waits for ComfyUI to be idle, in seconds "
            "outside sampling runs, added up.", doc="docs/compile_model.md"),
    # compile/child/serve.py NICE_ENV
    Setting("ACCEL_BACKGROUND_NICE", "number", "unset: the idle class",
            "A whole number: the background child takes that niceness (`os.nice`) instead of the idle scheduling "
            "class.", doc="docs/compile_model.md"),
)


def setting(name: str) -> Setting:
    """The entry of SETTINGS named `name`."""
    for entry in SETTINGS:
        if entry.name == name:
            return entry
    raise KeyError(f"{name} is not in accel/env_settings.py's SETTINGS: add it there, then run "
                   f"`python -m tools.env_table --write`")
