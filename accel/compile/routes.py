"""How one model call runs (`CallPlan`) and, in it, the route of each block kind (`Route`): decided once, before
the call, by auto_mode.plan_call through `fill_routes` (the VAE's calls by vae.py, the same way), and final for the
call. A dispatcher (dispatch.py) binds its route's runner when it is installed and runs it without deciding again.

A route depends on the kind's state and the plan, never on the call's inputs. What does depend on them is answered
per block call in one place (blocks.BlockSite.compiled_call: another node's patch; the dispatcher's install:
offloaded weights) and, for a compiled kind, by its graphs (a new shape, a guard they refuse), which the route's
runner then acts on: it runs the block eagerly, captures it for a child, or compiles it here.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .background.activity import Window
from .background.decision import carry_out, decide_background


class CallMode(enum.Enum):
    PROFILE = "profile"  # eager, each kind's share of the call timed
    DISPATCH = "dispatch"  # each block on its kind's path (undecided kinds timed on their real calls)
    CHECK_COMPILED = "check compiled"  # a whole-call sample with the chosen paths
    CHECK_EAGER = "check eager"  # a whole-call sample with ComfyUI's own forward everywhere
    EAGER = "eager"  # the verdict: no dispatch at all


class Route(enum.Enum):
    PLAIN = "ComfyUI's forward, uncounted: a whole-call eager sample"
    PROFILE = "ComfyUI's forward, timed for the kind's share of the call"
    BACKGROUND = "eager while a child compiles the kind (its first block's inputs captured for it)"
    LOADING = "eager until the kind's precompiled graphs load, between prompts"
    COMPILED = "compiled, compiling here what is missing (choose='always compiled')"
    CHOSEN = "the kind's chosen path, timed on real calls while undecided; its compiled side may compile here"
    CHOSEN_OFF_PROMPT = "the kind's chosen path; inputs its graphs do not serve run eagerly while a child compiles"


@dataclass
class CallPlan:
    """How one call runs, decided once before it, and what it measured (filled in during it)."""
    mode: CallMode
    always_compiled: bool
    background: bool  # cold kinds may be captured for the background compiler in this call
    device_type: str
    compiles_here: int = 0  # kinds this call may compile in this process (ComfyUI's progress bar counts them)
    settled_before: tuple | None = None  # check calls: the model's state before, to tell a clean sample
    captures: dict = field(default_factory=dict)  # kind key -> background.Capture
    kind_seconds: dict = field(default_factory=dict)  # PROFILE: seconds per kind key
    blocks: int = 0
    served_before: tuple | None = None  # the kinds' counts of compiled and eager block calls before the call
    new_shapes_in_background: bool = False  # a compiled kind's new input shape may go to a child in this call
    compiles_in_background: bool = False  # the model's options let a child compile (choose=auto, background)
    window: Window | None = None  # the pack's own work seen from the call's start (a sample only if none)
    graphs_missing: bool = False  # some block ran eagerly for a graph not here yet (a child's, or loading)
    routes: dict = field(default_factory=dict)  # kind key -> Route (fill_routes): final for the call
    to_background: set = field(default_factory=set)  # kind keys a child compiles: their blocks wait, or are captured
    graphs: object = None  # cuda_graphs.GraphCall: the kinds that replay CUDA graphs in this call (opt-in)
    block_options: dict = field(default_factory=dict)  # what compiled blocks get in fresh options (attention.py)
    saves_compiled: bool = False  # what compiles here in this call goes to a child to be saved whole (decision.py)

    @property
    def timed(self) -> bool:
        """The whole call's time is a measurement (so it waits for the device before and after)."""
        return self.mode in (CallMode.PROFILE, CallMode.CHECK_COMPILED, CallMode.CHECK_EAGER)

    def fill_routes(self, entries) -> "CallPlan":
        """Each kind's route for this call (entries: kinds.KindEntry, one per block; each kind decided once)."""
        for entry in entries:
            if entry.key not in self.routes:
                self.routes[entry.key] = self._route_of(entry)
        return self

    def _route_of(self, entry) -> Route:
        if self.mode is CallMode.CHECK_EAGER:
            return Route.PLAIN
        # The background decision first (background/decision.py), carried out now: it may find the kind's graphs
        # in the cache, due to load between prompts, or have it wait for inductor's CPU checks.
        if self.background:
            step = decide_background(entry)
            if entry.background.waiting or (step is not None and carry_out(entry, step)):
                self.to_background.add(entry.key)

        if self.mode is CallMode.PROFILE:
            return Route.PROFILE  # its blocks are captured all the same, when the kind goes to a child
        if entry.key in self.to_background:
            return Route.BACKGROUND
        if self.new_shapes_in_background and entry.loads_between_prompts:
            return Route.LOADING
        if self.always_compiled:
            return Route.COMPILED
        # A kind served by precompiled functions always asks them first and compiles nothing here: its guards
        # are checked at every call anyway, and they may refuse what the model-level shapes did not show (an
        # inference tensor where the child's graph had a normal one).
        if self.new_shapes_in_background or (self.compiles_in_background and entry.precompiled.expected):
            return Route.CHOSEN_OFF_PROMPT
        return Route.CHOSEN
