"""The activation memory of a trained token, from the model's shape alone (no torch): the
trainer sizes its micro-batches with it and the memory plan (`arl.control.memory`) budgets them."""

from __future__ import annotations


def activation_bytes_per_token(config: object, gradient_checkpointing: bool) -> float:
    """Bytes of activations one trained token keeps for backward, from the model's shape
    (``config`` has HF's ``hidden_size``, ``intermediate_size``, ``num_hidden_layers``).

    Per decoder layer in 16-bit: ~34 x hidden (norm inputs and outputs, q/k/v, attention
    output, residuals, fp32 norm statistics) and ~10 x intermediate (gate, up, activation,
    product); gradient checkpointing keeps only each layer's input. An estimate (on an H200:
    SmolLM2-135M peaked at ~1.0 MB a token against 1.06 estimated, Qwen2.5-1.5B's shape at
    ~3.0 MB against 3.96); taking half the free memory is the margin.
    """
    hidden = int(getattr(config, "hidden_size", 1024))
    inter = int(getattr(config, "intermediate_size", 4 * hidden))
    layers = int(getattr(config, "num_hidden_layers", 1))
    per_layer = 2 * hidden if gradient_checkpointing else 34 * hidden + 10 * inter
    return float(layers * per_layer + 8 * hidden)
