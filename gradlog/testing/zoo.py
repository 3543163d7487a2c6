"""A small zoo of deterministic models and batches for gradlog tests.

Every builder takes a ``seed`` and produces the same weights / data for the same arguments,
independently of the global torch RNG state (which is left untouched). Models default to
``torch.float64`` so tests can compare per-sample gradients with tight tolerances.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gradlog.demo.model import CharGPT, GPTConfig

__all__ = ["gpt_batch", "mlp", "mlp_batch", "per_token_ce", "tiny_gpt"]

# Shapes of the default MLP, shared by `mlp` and `mlp_batch`.
_MLP_D_IN = 6
_MLP_D_OUT = 3


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def mlp(
    d_in: int = _MLP_D_IN,
    hidden: int = 8,
    d_out: int = _MLP_D_OUT,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
) -> nn.Module:
    """Build a ``Linear -> Tanh -> Linear`` classifier with seeded weights.

    Args:
        d_in: Input features.
        hidden: Hidden width.
        d_out: Number of classes (output logits).
        seed: Seed for the weights.
        dtype: Parameter dtype.

    Returns:
        An ``nn.Sequential`` mapping ``(B, d_in)`` to ``(B, d_out)``.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, d_out))
    return model.to(dtype)


def mlp_batch(
    B: int,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    d_in: int = _MLP_D_IN,
    n_classes: int = _MLP_D_OUT,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Make a seeded classification batch for :func:`mlp`.

    Args:
        B: Batch size.
        seed: Seed for the data.
        dtype: Dtype of the inputs.
        d_in: Input features (must match the model).
        n_classes: Number of classes (must match the model's ``d_out``).

    Returns:
        ``(x, y)`` with ``x`` of shape ``(B, d_in)`` and ``y`` of shape ``(B,)`` (long class
        targets in ``[0, n_classes)``).
    """
    gen = _generator(seed)
    x = torch.randn(B, d_in, generator=gen, dtype=torch.float64).to(dtype)  # (B, d_in)
    y = torch.randint(0, n_classes, (B,), generator=gen)  # (B,)
    return x, y


def tiny_gpt(
    *,
    vocab: int = 11,
    block_size: int = 8,
    n_layer: int = 1,
    n_head: int = 2,
    n_embd: int = 8,
    tie_weights: bool = False,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
) -> CharGPT:
    """Build a tiny :class:`~gradlog.demo.model.CharGPT` with seeded weights.

    Args:
        vocab: Vocabulary size.
        block_size: Maximum sequence length.
        n_layer: Number of transformer blocks.
        n_head: Attention heads.
        n_embd: Embedding width (divisible by ``n_head``).
        tie_weights: Share the head weight with the token embedding.
        seed: Seed for the weights.
        dtype: Floating-point dtype of the parameters.

    Returns:
        The model, in eval mode (dropout is 0 anyway).
    """
    config = GPTConfig(
        vocab_size=vocab,
        block_size=block_size,
        n_layer=n_layer,
        n_head=n_head,
        n_embd=n_embd,
        tie_weights=tie_weights,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = CharGPT(config)
    return model.to(dtype).eval()


def gpt_batch(
    B: int,
    T: int,
    *,
    vocab: int = 11,
    seed: int = 0,
    pad_frac: float = 0.25,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Make a seeded token batch with right padding for :func:`tiny_gpt`.

    Roughly ``pad_frac`` of the sequences are padded: their last positions are marked as
    padding in ``mask``. Every sequence keeps at least one real token. Padded positions of
    ``x`` and ``y`` hold token 0 (still valid ids, so the model accepts them).

    Args:
        B: Batch size.
        T: Sequence length.
        vocab: Vocabulary size.
        seed: Seed for the data.
        pad_frac: Fraction of sequences that get padding, in ``[0, 1]``.

    Returns:
        ``(x, y, mask)``: ``x`` and ``y`` of shape ``(B, T)`` (long), ``mask`` of shape
        ``(B, T)`` (bool), True for real tokens and False for padding.
    """
    if not 0.0 <= pad_frac <= 1.0:
        raise ValueError(f"pad_frac must be in [0, 1], got {pad_frac!r}.")
    gen = _generator(seed)
    x = torch.randint(0, vocab, (B, T), generator=gen)  # (B, T)
    y = torch.randint(0, vocab, (B, T), generator=gen)  # (B, T)
    lengths = torch.full((B,), T, dtype=torch.long)  # (B,)
    n_pad = round(pad_frac * B) if T > 1 else 0
    if n_pad > 0:
        rows = torch.randperm(B, generator=gen)[:n_pad]  # (n_pad,)
        lengths[rows] = torch.randint(1, T, (n_pad,), generator=gen)  # lengths in [1, T)
    mask = torch.arange(T)[None, :] < lengths[:, None]  # (B, T)
    x = x.masked_fill(~mask, 0)  # (B, T)
    y = y.masked_fill(~mask, 0)  # (B, T)
    return x, y, mask


def per_token_ce(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy.

    Args:
        logits: Shape ``(B, T, V)``.
        y: Long targets of shape ``(B, T)``.

    Returns:
        Losses of shape ``(B, T)`` (no reduction).
    """
    return F.cross_entropy(logits.transpose(1, 2), y, reduction="none")  # (B, T)
