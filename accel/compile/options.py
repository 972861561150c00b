"""The user's compile choices, validated once, and what they mean for torch.compile."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..env_settings import env_switch

MODES = ("default", "max-autotune-no-cudagraphs", "reduce-overhead", "low-memory")
# low-memory: no CUDA graphs, no autotuning, repeated blocks only, and kernels compiled in this process rather
# than in a pool of compile workers (each worker is a process of its own holding torch).
LOW_MEMORY_INDUCTOR_OPTIONS = {"compile_threads": 1, "max_autotune": False, "triton.cudagraphs": False}
DYNAMIC = ("auto", "static", "dynamic")
SCOPES = ("auto", "repeated blocks", "whole model")
CHOOSE = ("auto", "always compiled")
CUDA_GRAPHS_SWITCH = "ACCEL_CUDA_GRAPHS"


@dataclass(frozen=True)
class CompileOptions:
    mode: str = "default"
    dynamic: str = "auto"
    scope: str = "auto"
    # auto: skip kinds too small to matter, time compiled against eager per kind, then whole calls (auto_mode.py).
    choose: str = "auto"
    # choose="auto": a kind's cold compile runs in a child process while its blocks run eagerly (background/).
    background: bool = True
    backend: str = "inductor"
    # CUDA graphs over the compiled blocks' calls (cuda_graphs.py): opt-in (ACCEL_CUDA_GRAPHS=1) until a GPU
    # measures them; on a CPU they are off and the node's status says why. No compiled code changes (not in
    # cache_key). An environment switch, not a node input: no saved workflow changes for an experiment.
    cuda_graphs: bool = field(default_factory=lambda: env_switch(CUDA_GRAPHS_SWITCH) is not None)

    def __post_init__(self):
        for name, allowed in (("mode", MODES), ("dynamic", DYNAMIC), ("scope", SCOPES), ("choose", CHOOSE)):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"Compile Model: {name}={value!r} is not one of {', '.join(allowed)}; "
                                 f"pick one of those in the node.")

    @property
    def whole_model(self) -> bool:
        return self.scope == "whole model" and self.mode != "low-memory"

    @property
    def may_use_a_child(self) -> bool:
        """A background child may work for these options: low-memory mode promises no extra processes, and a whole
        model is never sent to one."""
        return self.mode != "low-memory" and not self.whole_model

    @property
    def compiles_in_background(self) -> bool:
        """Only auto mode may run blocks eagerly until they are compiled ("always compiled" means compiled from
        the first call), and low-memory mode promises no extra processes."""
        return self.background and self.choose == "auto" and self.may_use_a_child

    def torch_compile_kwargs(self, device_type: str) -> dict:
        """kwargs for torch.compile (the hardware policy has already turned modes this device lacks into default)."""
        dynamic = {"auto": None, "static": False, "dynamic": True}[self.dynamic]
        if self.mode == "low-memory":
            # torch.compile applies `options` to inductor's config for this compile only: nothing global changes
            return {"backend": self.backend, "options": dict(LOW_MEMORY_INDUCTOR_OPTIONS), "dynamic": dynamic}
        mode = None if self.mode == "default" else self.mode
        return {"backend": self.backend, "mode": mode, "dynamic": dynamic}

    def cache_key(self, device_type: str) -> tuple:
        """What of these options changes the compiled code. `choose` does not (it picks between compiled and
        eager), `background` does not (it says where), and neither does `scope` (a whole model and a block are
        different kinds anyway)."""
        kwargs = self.torch_compile_kwargs(device_type)
        return (kwargs["backend"], self.mode, kwargs["dynamic"])
