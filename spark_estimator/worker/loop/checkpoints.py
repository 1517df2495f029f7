"""Executor (rank 0): one checkpoint per finished epoch in the store, and their retention.

A checkpoint holds everything needed to continue after its epoch (see ``worker.loop.resume``).
Each is written atomically (``Store.write_bytes``). With ``keep`` set, only the last
``keep`` epochs' checkpoints stay, plus any epoch named in ``protected`` (the best epoch,
when a BestModel callback tracks one). With ``parallelism="fsdp"`` every rank first writes
its shard of the model and optimizer (``shards``, ``worker.loop.sharded``); a pruned checkpoint's
file goes before its shards, so no listed checkpoint lacks them.
"""

from __future__ import annotations

from ...shared.serialization import state_to_bytes
from ...store import Store

SHARDS = "shards"  # the key naming a checkpoint's or commit's shards' folder (worker.loop.sharded)


class Checkpoints:
    def __init__(self, store: Store, run_id: str, keep: int | None):
        self.store, self.run_id, self.keep = store, run_id, keep

    def path(self, epoch: int) -> str:
        return self.store.run(self.run_id).checkpoint(epoch)

    def shards(self, epoch: int) -> str:
        """The folder of the epoch's shards (``parallelism="fsdp"``)."""
        return self.store.run(self.run_id).shards(f"epoch-{epoch:04d}")

    def epochs(self) -> list[int]:
        """Epochs with a checkpoint in the store, ascending."""
        return self.store.checkpoint_epochs(self.run_id)

    def write(self, epoch: int, state: dict, protected: set[int] = frozenset()) -> None:
        self.store.write_bytes(self.path(epoch), state_to_bytes({"epoch": epoch, **state}))
        self.prune(protected)

    def prune(self, protected: set[int] = frozenset()) -> None:
        """Remove all but the last ``keep`` epochs' checkpoints, and those ``protected``."""
        if self.keep is None:
            return
        for old in self.epochs()[: -self.keep]:
            if old not in protected:
                self.store.remove(self.path(old))
                self.store.remove(self.shards(old))

    def last(self) -> str | None:
        """The newest checkpoint's path, or None when there is none yet."""
        epochs = self.epochs()
        return self.path(epochs[-1]) if epochs else None
