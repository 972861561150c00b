"""The background compiler's child process: `python -m accel compile-worker DIR` (accel/__main__.py).

What runs only in a process of its own, never in ComfyUI's: the child, and `python -m accel precompile`'s last step
(accel/precompile.py), which compiles as the child does. The engine (accel/compile/ outside this package, accel/cache/,
nodes/) never imports it, not even inside a function (tests/test_layout.py); this package uses the engine through its
public names only. The parent's side, which schedules the jobs and reads what they left, is compile/background/.

- serve.py: the child's main loop, a job directory per line on its stdin; its priority, and its end with ComfyUI's;
- compile_kind.py: one captured kind compiled (`compile_item`) and its graphs saved whole (`save_precompiled`);
- saving.py: the saving half of precompiled graphs (torch's AOT precompile, the kernels packed with it, the file's
  name); the loading half is compile/precompiled.py;
- batch_twin.py: the child's second graph for a kind met at a batch of 1, for batches of 2 and more.
"""
