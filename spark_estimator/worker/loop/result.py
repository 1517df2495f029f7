"""Executor: the end of a rank's training (``LoopResult``, a part of the training loop):
rank 0 writes the run's result (the weights, or the best epoch's with BestModel; the
history; the training summary); every rank returns its summary, with its final weights'
digest (gathered whole from the shards with FSDP)."""

from __future__ import annotations

import torch.distributed as dist

from ...callbacks import EarlyStopping
from ...shared.serialization import state_dict_digest, state_to_bytes
from ...shared.spec import compile_backend
from ...shared.summary import RankSummary, seconds_per_rank, training_summary
from ..data.rank_data import rank_summary


class LoopResult:
    """What the training loop hands back (a mixin of the loop)."""

    def finish(self) -> RankSummary:
        """Rank 0 writes the result; every rank returns its summary."""
        model = self.objects.model
        selection = self.best.selection() if self.best else None
        elements = sum(p.numel() for p in model.parameters())
        if self.sharded:
            from ..comm import fsdp  # torch's FSDP: imported by sharded fits only

            elements = fsdp.local_elements(model)
            if selection:  # every rank's shard of the best epoch
                model.load_state_dict(self.best.best_state)
            weights = fsdp.full_state_dict(model)  # on rank 0; gathered by every rank
            digest = [state_dict_digest(weights) if self.info.rank == 0 else None]
            dist.broadcast_object_list(digest, src=0)
            best = weights
        else:
            weights = {k: v.detach().to("cpu") for k, v in model.state_dict().items()}
            digest = [state_dict_digest(weights)]
            best = self.best.best_state if selection else weights
        if self.info.rank == 0 and not self.paused:
            result = {
                "model": best,
                "history": self.state.history,
                "output_shapes": self.output_shapes,
                "summary": self._training_summary(selection),
            }
            store = self.spec.store
            store.write_bytes(store.run(self.spec.run_id).result, state_to_bytes(result))
        # process_group's closing barrier keeps every rank until rank 0 has written it
        return rank_summary(
            self.info,
            self.data,
            self.hook,
            digest[0],
            elements,
            self.batches_run,
            self.optimizer_steps_run,
            self.started,
            compile_backend(self.spec.loop.compile),
            self.paused,
        )

    def _training_summary(self, selection: dict | None) -> dict:
        loop, history = self.spec.loop, self.state.history
        stopped_by = [
            cb.stopped_epoch
            for cb in self.objects.callbacks
            if isinstance(cb, EarlyStopping) and cb.stopped_epoch
        ]
        return {
            **training_summary(
                self.info.world_size,
                self.spec.epochs,
                history,
                self.start_epoch,
                stopped_by[0] if stopped_by else None,
                selection,
                self.checkpoints.epochs(),
            ),
            "resumed_from_commit": self.resumed_commit,
            "commits": self.commits_made,
            "commit_seconds": round(self.commit_seconds, 4),
            "lr_scaling": loop.lr_scaling,
            "base_learning_rates": self.objects.base_lrs,
            "learning_rates": self.start_lrs,
            "backward_passes_per_step": loop.backward_passes_per_step,
            "gradient_compression": loop.gradient_compression,
            "gradient_reduction": loop.gradient_reduction,
            "mixed_precision": loop.mixed_precision,
            "parallelism": loop.parallelism,
            "seconds_per_rank": seconds_per_rank(history),
        }
