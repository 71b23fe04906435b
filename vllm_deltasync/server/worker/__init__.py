"""One rank inside a vLLM worker process (internal).

Two threads: the poller thread (:mod:`.poller`, :mod:`.discovery`) fills the rank's
:class:`~.state.SyncState`; the worker's main thread (:mod:`.rank`, :mod:`.apply`) writes staged
steps into the live parameters through the shard map (:mod:`.shardmap`) between model steps.
"""
