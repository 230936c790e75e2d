"""The checkpoint in flight: `rankmeter serve` sends a batch's store commit from one worker
thread and polls and decodes the next batch while the reply is outstanding (the wait was
about a tenth of the loop's time). One at most: a batch's commit is confirmed, and its
offsets handed to Kafka, before the next batch is applied, so every partition's
checkpoints reach the store in order, each expecting the mark of the one before."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from rankmeter.pipeline import Checkpoint
from rankmeter.source import Source


class InFlight:
    def __init__(self, source: Source) -> None:
        self.source = source
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rankmeter-checkpoint")
        self._sent: tuple[Checkpoint, Future[None]] | None = None

    @property
    def outstanding(self) -> bool:
        """A checkpoint sent and not settled yet."""
        return self._sent is not None

    def send(self, checkpoint: Checkpoint) -> None:
        """Step 2 (pipeline/checkpoint.py), from the worker thread."""
        if self._sent is not None:
            raise RuntimeError("a checkpoint is in flight already: settle it first")
        self._sent = (checkpoint, self._worker.submit(checkpoint.send))

    def settle(self) -> Checkpoint | None:
        """Wait for the commit in flight, if any; confirm it (step 3) and hand its offsets to
        the source (step 5). Raises the store's failure (`Checkpoint.send` has marked the
        batch unsure); the checkpoint is settled either way."""
        if self._sent is None:
            return None
        checkpoint, reply = self._sent
        self._sent = None
        try:
            reply.result()
        finally:
            # A failure's traceback holds this frame, the frame the future, the future the
            # failure: a cycle that would keep the batch alive, frozen for good (gc_tuning).
            del reply
        checkpoint.confirm()
        checkpoint.commit(self.source)
        return checkpoint

    def close(self) -> None:
        self._worker.shutdown(wait=True)
