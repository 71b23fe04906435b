"""Runs inside a vLLM server.

* :mod:`.extension`: the worker mixin (the ``deltasync_*`` RPC methods vLLM mixes into each
  worker).
* :mod:`.vllm`: the vLLM boundary, the only code that imports vLLM: the table of every vLLM
  symbol touched and its check, the plugin (two guarded patches), the hooks on an engine core
  naming the extension, the worker-side reads, the CPU GEMM dispatch.
* :mod:`.worker`: one rank, in every vLLM worker process: the poller thread (discover,
  download, verify, decode, prepare) and the worker's main thread (apply, revert, commit), with
  everything they share in one lock-owning :class:`~.worker.state.SyncState`.
* :mod:`.engine`: the engine core's busy loop: the coordinator that switches every rank between
  two batches, as one unit.
* :mod:`.metrics`: counters kept in the workers, Prometheus series and ``/synced`` served from
  the engine core.

Not a stable API: users start it with ``--worker-extension-cls
vllm_deltasync.DeltaSyncExtension`` and read it through metrics, ``/synced`` and the
``deltasync_*`` RPCs (docs/extension.md).
"""
