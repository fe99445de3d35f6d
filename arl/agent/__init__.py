"""Agents as rollout: an OpenAI-shaped client over arl's engines, and what it records.

    async def run(client, data):
        r = await client.chat.completions.create(messages=data["messages"])
        return r.choices[0].message.content  # scored by rollout.reward

`arl.agent.client` holds the client, `arl.agent.chat_format` the model's chat and tool-call
format, `arl.agent.trajectory` the recorded completions -> trajectory rows, and
`arl.workflows.agent` runs such code as the rollout workflow.
"""

from arl.agent.chat_format import PromptTooLong
from arl.agent.client import ChatClient, ChatCompletion, CompletionRecord

__all__ = ["ChatClient", "ChatCompletion", "CompletionRecord", "PromptTooLong"]
