"""``disk``: an HF safetensors folder per version, reloaded by every engine (server engines too).

The train ranks write ``<run>/weights/v<N>`` (rank 0 writes, atomically); each engine reloads
it (the hf engine copies it in; SGLang and vLLM reload from the path); the folder is removed
after. The fallback that works with every engine, and the only mode for server engines.
With LoRA the ranks' ``save_hf`` writes a peft adapter folder instead: the hf engine copies the
adapter in (`update_weights_from_disk` sees ``adapter_config.json``), the servers load it by a
versioned name (``arl-v<N>``) and unload the previous one.
"""

from __future__ import annotations

import asyncio
import shutil

from arl.protocol.proxy import proxy
from arl.protocol.remote import TrainWorkerAPI
from arl.weights.base import ReceiverPart, WeightSync
from arl.weights.rules import DiskRule


class DiskSync(DiskRule, WeightSync):
    """Controller half: save on the train ranks, reload in every engine, remove the folder."""

    async def setup(self) -> None:
        """Agree on the dtype; place the receivers."""
        await super().setup()
        self.directory = self.ctx.run_path / self.run_dirs[0]
        self.receivers = await self.place(DiskReceiver, self.ctx.cluster.rollout, host="rollout")

    async def stage(self, version: int) -> None:
        """Every train rank takes part in writing the folder of ``version``."""
        path = str(self.directory / f"v{version}")
        await asyncio.gather(*(proxy(TrainWorkerAPI, w).save_hf(path) for w in self.ctx.train))

    async def transfer(self, version: int) -> None:
        """Every engine reloads the folder."""
        path = str(self.directory / f"v{version}")
        await asyncio.gather(*(r.load(path) for r in self.receivers))

    async def cleanup(self, version: int) -> None:
        """Remove the folder (the engines have loaded it)."""
        shutil.rmtree(self.directory / f"v{version}", ignore_errors=True)


class DiskReceiver(ReceiverPart):
    """Rollout node half: the engine's own reload from a folder."""

    async def load(self, path: str) -> None:
        """Reload the engine's weights from ``path`` (engine paused)."""
        await self.host.update_weights_from_disk(path)
