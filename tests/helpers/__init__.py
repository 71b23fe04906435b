"""What more than one test module shares, and no test: one module per kind of helper.

Test modules never import each other nor a conftest (``tests/test_architecture.py`` checks it);
what they share lives here, and a folder's ``conftest.py`` keeps only its fixtures and hooks
(built from these helpers).

=====================  ======================================================================
module                 what
=====================  ======================================================================
``waiting``            ``wait_until``: a condition polled to a deadline, failing with what
                       was awaited (instead of a sleep long enough on a good day)
``net``                ``free_port``, ``http_get``
``cores``              the cores each pytest-xdist worker's engines bind to
``loopserver``         ``LoopServer``: an aiohttp server on its own loop and thread
``hosts``              the host's CPU and AMX tiles, stock-engine probes, skip reasons
``host_probe``         the probe itself (``python -m tests.helpers.host_probe KIND DIR``)
``hubserver``          the local Hugging Face bucket server (loopback; fault switches)
``mirrorserver``       nginx as a caching mirror, and mirrors that fail on purpose
``transports``         moto's credentials, the test uploader of hf://, a mirror's origin
``publishing``         ``Trainer`` (fp32 masters, Adam-like steps), ``publish_run``,
                       ``read_full``, ``bits_equal``, the CLI as a child process
``codec``              bf16 bit patterns, ``deltas`` (the roundtrip cases), publish-and-read
``faults``             ``Hostile`` (a misbehaving aiohttp server), planted secrets, the CLI
                       in this process, hostile manifest rewrites
``follow``             ``Follower``: a rank without vLLM (the real poller, live tensors)
``fake_engine``        a stand-in of vLLM's engine core and wire-speaking ranks
``tp_world``           vLLM's model classes at any TP rank in one process; ``make_step``
``monitoring``         a real Prometheus on loopback, exposition parsing, rank statuses
``lora``               tiny PEFT models and their trainer
``torchrun``           ``torchrun``: ``dist_worker.py`` under torchrun (gloo, CPU)
``dist_worker``        the multi-rank trainer scenarios torchrun runs
``engines``            real vLLM engines and API servers, the bucket an engine follows, a
                       script in a child process, HTTP calls to an API server
``engine_hooks``       ``switch_every_steps_env`` and the test-only vLLM plugin (``plugin/``)
``lora_serving``       LoRA adapters trained, published and served by a real API server
``drafter``            a speculative engine and its greedy tokens (also run in a child)
``layout``             the scans of the test-layout rules of ``tests/test_architecture.py``
=====================  ======================================================================
"""
