"""Sampling one token per row of a decode step, and its log-prob, for the hf engine.

A sampled row draws its token by inverting the cumulative distribution with one uniform number:
the first token whose cumulative probability reaches ``u * total``. The usual alternative, the
Gumbel-max trick (argmax of ``logp`` plus Gumbel noise), draws one random number per vocabulary
entry: at 49k tokens that was 24 of the 27 ms a 24-row step spent sampling on one CPU core,
where the inversion takes 3 ms (docs/results.md); on a GPU it also reads and writes the logits
fewer times. Both sample softmax(logp) exactly, up to float rounding.

The cumulative sum of non-negative float32 weights never decreases, and ``u`` lies in (0, 1],
so the chosen index is always a token of positive weight (a zero-weight token does not raise
the sum, so the search never stops on one) and never past the last.

On CUDA, rows that do not truncate go through one Triton kernel (`kernels.sample_plain`: the
same draw from the same uniform numbers, two passes over the logits instead of five); a machine
where it fails to build keeps this torch code.
"""

from __future__ import annotations

import logging

import torch

from arl.engines.hf import kernels
from arl.precompile import first_line

logger = logging.getLogger(__name__)

_KERNEL = {"failed": False}


def sample_rows(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    greedy: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    generator: torch.Generator,
    *,
    all_greedy: bool,
    truncate: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [n] and their log-probs [n] under log_softmax(logits / T), the untruncated
    distribution whatever top-p/top-k kept.

    ``logits`` [n, V]; per row: ``temperature`` (> 0), ``greedy`` (argmax instead), ``top_p``
    (keep the smallest most-likely prefix whose mass reaches it; >= 1 keeps all) and ``top_k``
    (keep that many; V keeps all). ``all_greedy`` skips drawing; ``truncate`` is whether any
    row truncates (else the sort is skipped).
    """
    if not truncate and not _KERNEL["failed"] and kernels.available(logits.device):
        try:
            return kernels.sample_plain(
                logits, temperature, greedy, generator, all_greedy=all_greedy
            )
        except Exception as exc:  # noqa: BLE001 - a Triton that cannot build it: torch's ops
            logger.warning("the sampling kernel failed (%s); sampling with torch", first_line(exc))
            _KERNEL["failed"] = True
    logp = torch.log_softmax(logits.float() / temperature[:, None], dim=-1)
    greedy_tok = logp.argmax(dim=-1)
    if all_greedy:
        tokens = greedy_tok
    elif truncate:
        sorted_lp, order = logp.sort(dim=-1, descending=True)
        probs = sorted_lp.exp()
        ranks = torch.arange(probs.shape[-1], device=probs.device)
        keep = ranks[None, :] < top_k[:, None]
        # The smallest prefix whose mass reaches top_p (the most likely token always).
        keep &= (probs.cumsum(dim=-1) - probs) < top_p[:, None]
        choice = _invert_cdf(probs.masked_fill_(~keep, 0.0), generator)
        tokens = torch.where(greedy, greedy_tok, order.gather(1, choice[:, None])[:, 0])
    else:
        tokens = torch.where(greedy, greedy_tok, _invert_cdf(logp.exp(), generator))
    return tokens, logp.gather(1, tokens[:, None])[:, 0]


def _invert_cdf(weights: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Per row of ``weights`` [n, V] (non-negative, some positive; consumed), an index drawn
    with probability proportional to its weight."""
    cdf = weights.cumsum_(dim=-1)
    u = 1.0 - torch.rand((cdf.shape[0], 1), generator=generator, device=cdf.device, dtype=cdf.dtype)
    return torch.searchsorted(cdf, u * cdf[:, -1:])[:, 0]
