"""What the bytes in a bucket mean: paths, manifests, codecs, and writing and reading a step.

No threads of its own and no vLLM: the trainer side (:mod:`vllm_deltasync.trainer`) writes
through :mod:`.writer`, servers and the CLI read through :mod:`.reader`. The specification is
docs/format.md; :mod:`.layout` holds the bucket paths, :mod:`.manifest` the manifest document,
:mod:`.codecs` the closed table of encodings, :mod:`.coverage` the rule every reader enforces.
"""
