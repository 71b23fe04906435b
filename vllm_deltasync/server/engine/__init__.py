"""The engine core's side (internal): :mod:`.coordinator` runs on vLLM's busy-loop thread and
switches every rank between two scheduler steps."""
