"""What a poller round learns from what went wrong: whether the applied step left the
bucket's chain (:func:`branch_change`), whether a step that failed to read was replaced meanwhile
(:func:`rewritten`), and which step and stage a failure belongs to (:func:`failed_step`,
:func:`failed_stage`, from the notes the poller attaches)."""

from __future__ import annotations

from vllm_deltasync.errors import FingerprintError, IntegrityError, NotFoundError
from vllm_deltasync.format.manifest import Manifest
from vllm_deltasync.format.reader import BucketReader, short_id


def branch_change(applied: Manifest, current: Manifest | None, bad: str = "") -> str | None:
    """Why the applied step is no longer on the bucket's chain (its manifest there is gone,
    unreadable: ``bad``, or another), or None when the bucket still holds it."""
    if current is not None and current.identity == applied.identity:
        return None
    if current is None:
        now_holds = f"holds no readable step {applied.step}{f' ({bad})' if bad else ''}"
    else:
        now_holds = (f"holds another step {applied.step} ({short_id(current.identity)}, run "
                     f"{current.run_id}, writer {current.writer})")
    return (f"branch changed: the applied step {applied.step} ({short_id(applied.identity)}, "
            f"run {applied.run_id}) is no longer in the bucket's chain: the bucket now "
            f"{now_holds} (a trainer restart, another writer or a wiped bucket); serving "
            "it until the newest anchor of the bucket's chain applies")


async def loaded_manifest(reader: BucketReader, step: int) -> Manifest | None:
    """The bucket's step ``step`` read afresh (``loaded_step``), None when it has none."""
    try:
        return await reader.manifest(step, fresh=True)
    except NotFoundError:
        return None


async def rewritten(reader: BucketReader, manifest: Manifest) -> bool:
    """A step whose data failed to read: is its manifest still the one planned with?
    (Data of a removed or replaced step is gone; that is not a corrupt step.)"""
    try:
        current = await reader.manifest(manifest.step, fresh=True)
    except Exception:  # noqa: BLE001 - gone or unreadable: replaced, plan again
        return True
    return current.identity != manifest.identity


def failed_step(exc: BaseException) -> int | None:
    for note in reversed(getattr(exc, "__notes__", ()) or ()):
        if note.startswith("step=") and note[5:].isdigit():
            return int(note[5:])
    return None


def failed_stage(exc: BaseException) -> str:
    if isinstance(exc, IntegrityError):
        return "verify"
    if isinstance(exc, FingerprintError):
        return "discover"
    for note in reversed(getattr(exc, "__notes__", ()) or ()):
        if note.startswith("stage="):
            return note[len("stage="):]
    return "discover"


__all__ = ["branch_change", "failed_stage", "failed_step", "loaded_manifest", "rewritten"]
