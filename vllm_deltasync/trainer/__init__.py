"""Runs in the trainer's process: :class:`~.publisher.DeltaPublisher` diffs each optimizer
step against its bf16 copy and publishes it; :mod:`.trl_import` replays a TRL delta-sync bucket.
"""
