"""The vLLM boundary: the only code of the package that imports vLLM or reaches into it.

- ``surface.py``: every vLLM symbol touched, why, what happens without it, and the check of
  that table against any vLLM source (engine start, ``tests/server/vllm/test_surface.py``,
  ``scripts/check_vllm.py``).
- ``plugin.py``: the ``vllm.general_plugins`` entry point (guarded patches of the engine core's
  ``__init__`` and busy loops, and of the CPU GEMM dispatch on the CPU platform).
- ``engine.py``: the coordinator's hooks on the instance of an engine core naming the extension.
- ``worker.py``: what a rank reads from vLLM's worker and model runner.
- ``cpu_gemm.py``: the CPU build's Linear dispatch.
"""
