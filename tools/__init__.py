"""Developer tooling (set-up, generated models, demo, server harness). Not loaded by ComfyUI."""
