"""What of a block's calls goes to a background child (`ToChild`, one per dispatcher: dispatch.py): a cold kind's
blocks captured for its first compile, a compiled kind's call of inputs its graphs do not serve (refused by
Dynamo's guards, or predicted by the kind's shapes), and the one place a capture is made (`capture`). The captures
of a call are the plan's (routes.CallPlan.captures), sent when the call ends (auto_mode.send_captures)."""
from __future__ import annotations

from .background import Capture
from .kinds import KindEntry
from .routes import CallPlan
from .shapes import CompiledCall

IN_BACKGROUND = "compiling in the background"


class ToChild:
    """One block's (or VAE coding method's) calls as a child gets them, in one call's plan."""

    def __init__(self, site, entry: KindEntry, plan: CallPlan):
        self.site, self.entry, self.plan = site, entry, plan

    def cold_call(self, args: tuple, kwargs: dict) -> str:
        """For a kind the plan sends to a child (`to_background`): why this block runs eagerly. The blocks of a kind
        that must be compiled cold are captured (their inputs' layouts) for the child process."""
        plan, entry = self.plan, self.entry
        if entry.key not in plan.captures and not entry.background.undecided:
            return IN_BACKGROUND  # a child has it, or it settled since the plan: eager for the rest of the call
        call = self.site.compiled_call(args, kwargs, plan.block_options)
        if isinstance(call, str):  # patched in this call: a later block of the kind is captured
            return IN_BACKGROUND if entry.background.waiting else call
        self.capture(call)
        return IN_BACKGROUND

    def refused_new_shape(self, call: CompiledCall) -> bool:
        """The call's inputs need a graph the compiled kind does not have (Dynamo refused them). True when the call
        runs eagerly because a child compiles that graph (captured now; or a child is already on the kind) or saved
        it and this process loads it between prompts (loader.py); False when nothing else will: the kind compiles
        it here, as before background compiles (a child failed on it)."""
        entry = self.entry
        background = entry.background
        if call.signature in entry.shapes.shapes_sent:
            return background.compiling_new_shape or entry.precompiled.due
        capture = self.plan.captures.get(entry.key)
        if capture is not None and capture.new_shape:  # another new shape in this call: the same child
            self.capture(call, new_shape=True)
            return True
        if background.compiling_new_shape:
            return True  # a child works on this kind: these inputs go to the next one, from a later call
        if not background.may_compile_new_shape or (entry.first_call is None and not entry.precompiled.expected):
            return False
        self.capture(call, new_shape=True)
        return True

    def predicted_new_shape(self, call: CompiledCall) -> bool:
        """For a kind with graph breaks (no `can_refuse_compiles`): True when this call of a compiled kind runs
        eagerly because its inputs' shape would compile a new graph, as `would_compile` predicts: the call is
        captured and a child compiles that graph, as it does a kind's first one. Shapes already compiled keep
        running compiled meanwhile."""
        entry = self.entry
        background = entry.background
        if entry.choice.path != "compiled" or entry.failure or not (
                background.compiling_new_shape or background.may_compile_new_shape):
            return False
        if background.compiling_new_shape:
            capture = self.plan.captures.get(entry.key)
            if capture is not None and capture.new_shape:  # another new shape in this call: the same child
                self.capture(call, new_shape=True)
            return call.signature not in entry.shapes.seen_inputs
        if entry.first_call is None or not entry.shapes.would_compile(call.args, call.kwargs):
            return False
        self.capture(call, new_shape=True)
        return True

    def compiled_here(self, call: CompiledCall, first: bool) -> None:
        """The kind just compiled a graph for `call` in this process (`first`: its first): captured, so that a child
        saves it whole as it saves what it compiles itself, and a restart or a fleet worker loads it instead of
        tracing it (issue #71: one compile path). Only where a child could save it: a kind of one graph (a graph
        break is never saved whole), no child on the kind and none failed on it, and no other capture of the kind
        in this call. Its blocks keep running the graph compiled here; nothing waits for the save. The call has run,
        and a block writes into its transformer_options: the layouts are taken of the call's inputs built afresh
        (`again`), as the graph was given them, or the child's graph would guard on the keys the block added and
        serve no later call."""
        entry, plan = self.entry, self.plan
        capture = plan.captures.get(entry.key)
        if capture is not None:  # a second graph compiled in this call: the same save; or another job's capture
            if capture.save:
                capture.add_call(call.signature, *call.again())
            return
        if entry.graph_breaks or entry.failure or not entry.background.may_save:
            return
        # after the kind's first graph, its first call's layouts come first: the child makes the same
        # static-then-dynamic graphs this process did
        capture = plan.captures[entry.key] = Capture.in_this_call(
            entry, self.site.module, self.site.attribute, save=True,
            calls=[] if first or entry.first_call is None else [entry.first_call])
        entry.background.save()
        capture.add_call(call.signature, *call.again())

    def capture(self, call: CompiledCall, new_shape: bool = False, into: dict | None = None) -> None:
        """This block call's inputs, captured for a child: the one place a capture is made. One Capture per kind in
        `into` (the plan's captures, sent when the call ends; precompile's record), a call's layouts once per
        signature. Made in the plan's captures, it moves the kind's background state: captured (its first cold
        compile) or a new shape's, whose layouts follow the kind's first call (so the child makes the same
        static-then-dynamic graphs this process would) and whose signature is noted as sent."""
        entry = self.entry
        own = into is None
        into = self.plan.captures if own else into
        capture = into.get(entry.key)
        if capture is None:
            first = [entry.first_call] if new_shape and entry.first_call else []
            capture = into[entry.key] = Capture.in_this_call(entry, self.site.module, self.site.attribute,
                                                             new_shape=new_shape, calls=first)
            if own:
                entry.background.new_shape() if new_shape else entry.background.capture()
        capture.add_call(call.signature, call.args, call.kwargs)
        if new_shape:
            entry.shapes.shapes_sent.add(call.signature)
