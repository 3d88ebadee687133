"""Integrity (SPEC.md section 5): a step file's bytes are the bytes that were written.

TraceWriter records ``content_sha256`` (sha256 over every tensor's name, dtype, shape and bytes,
``tracer.format.hashing.content_sha256``) in each step file's header. A flipped bit on disk, a bad copy, or
tensors rewritten with the old metadata all leave a file that still opens and looks healthy, and
every other check would then judge data the trainer never produced. This check hashes the bytes
(``tracer.format.integrity.verify_step_file``, the same verification ``tracer diff`` and ``tracer info
--verify`` run) and reports a mismatch as an error naming the file. A step file without a
recorded checksum (not written by TraceWriter) cannot be verified: the check is skipped there.
"""

from __future__ import annotations

from tracer.checks.context import StepContext
from tracer.checks.finding import ERROR, Skip, register
from tracer.errors import ChecksumError, TraceFormatError
from tracer.format.integrity import verify_step_file


@register("integrity.checksum", "the step file's tensor bytes hash to the content_sha256 its header records")
def check_checksum(ctx: StepContext):
    try:
        recorded = verify_step_file(ctx.key.path)
    except ChecksumError as err:
        return [ctx.finding("integrity.checksum", ERROR, f"{err}. Why it matters: every other finding on this "
                            "step describes bytes the trainer did not write.")]
    except TraceFormatError as err:
        return [ctx.finding("integrity.checksum", ERROR, f"could not verify the checksum: {err}")]
    if recorded is None:
        raise Skip("no content_sha256 in the step file's header (not written by TraceWriter): its bytes cannot be "
                   "verified")
    return []
