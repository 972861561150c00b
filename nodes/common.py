"""What every Accel node shares: its menu category and its logger."""
import logging

CATEGORY = "Accel"
log = logging.getLogger("comfyui_accel")
