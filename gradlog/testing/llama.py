"""A tiny Llama-style language model for tests: RMSNorm, rotary embeddings, SwiGLU MLP.

Pre-norm decoder blocks (``x + attn(norm(x))``, ``x + mlp(norm(x))``) with rotary position
embeddings on queries and keys, causal attention without biases, a SwiGLU MLP
(``w2(silu(w1 x) * w3 x)``), a final RMSNorm and an untied ``lm_head`` (no bias), as in Llama.
:meth:`TinyLlama.hidden` returns the final normalised hidden states, so tests can put either
the plain head or :func:`gradlog.memory.chunked_linear_loss` on top.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LlamaConfig", "TinyLlama", "tiny_llama"]


@dataclass(frozen=True)
class LlamaConfig:
    """Sizes of :class:`TinyLlama`.

    Attributes:
        vocab_size: Tokens in the vocabulary (rows of ``lm_head``).
        dim: Hidden size.
        n_layers: Decoder blocks.
        n_heads: Attention heads; ``dim`` must be a multiple of it, the head size even.
        hidden_dim: Inner size of the SwiGLU MLP.
        max_seq_len: Longest sequence the rotary tables cover.
        rope_theta: Base of the rotary frequencies.
        norm_eps: RMSNorm epsilon.
    """

    vocab_size: int = 128
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    hidden_dim: int = 64
    max_seq_len: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise ValueError(
                f"dim ({self.dim}) must be a multiple of n_heads ({self.n_heads}) with an even "
                "head size (rotary embeddings rotate pairs of features)."
            )


def _rotary_tables(config: LlamaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``(max_seq_len, head_dim / 2)`` of the rotary angles."""
    head_dim = config.dim // config.n_heads
    freqs = config.rope_theta ** (-torch.arange(0, head_dim, 2).double() / head_dim)  # (hd/2,)
    angles = torch.outer(torch.arange(config.max_seq_len).double(), freqs)  # (S, hd/2)
    return angles.cos().float(), angles.sin().float()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` ``(B, H, T, hd)`` with ``cos``/``sin`` ``(T, hd/2)``."""
    x1, x2 = x[..., 0::2], x[..., 1::2]  # (B, H, T, hd/2) each
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)  # (B, H, T, hd/2, 2)
    return out.flatten(-2)  # (B, H, T, hd)


class Attention(nn.Module):
    """Causal multi-head self-attention with rotary embeddings, no biases."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.wq = nn.Linear(config.dim, config.dim, bias=False)
        self.wk = nn.Linear(config.dim, config.dim, bias=False)
        self.wv = nn.Linear(config.dim, config.dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        H = self.n_heads
        q = self.wq(x).view(B, T, H, D // H).transpose(1, 2)  # (B, H, T, hd)
        k = self.wk(x).view(B, T, H, D // H).transpose(1, 2)  # (B, H, T, hd)
        v = self.wv(x).view(B, T, H, D // H).transpose(1, 2)  # (B, H, T, hd)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)  # (B, H, T, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, hd)
        return cast(torch.Tensor, self.wo(y.transpose(1, 2).reshape(B, T, D)))  # (B, T, D)


class SwiGLU(nn.Module):
    """``w2(silu(w1 x) * w3 x)``, no biases."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.hidden_dim, bias=False)
        self.w2 = nn.Linear(config.hidden_dim, config.dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, self.w2(F.silu(self.w1(x)) * self.w3(x)))  # (B, T, D)


class Block(nn.Module):
    """Pre-norm decoder block."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.feed_forward = SwiGLU(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)  # (B, T, D)
        return cast(torch.Tensor, x + self.feed_forward(self.ffn_norm(x)))  # (B, T, D)


class TinyLlama(nn.Module):
    """Token embedding, decoder blocks, final RMSNorm and an untied ``lm_head``."""

    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        cos, sin = _rotary_tables(config)
        self.register_buffer("rope_cos", cos, persistent=False)  # (S, hd/2)
        self.register_buffer("rope_sin", sin, persistent=False)  # (S, hd/2)

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        """Final normalised hidden states ``(B, T, D)`` of token ids ``(B, T)``."""
        T = tokens.shape[1]
        if self.config.max_seq_len < T:
            raise ValueError(
                f"sequence length {T} exceeds max_seq_len {self.config.max_seq_len}; build the "
                "model with a larger LlamaConfig.max_seq_len."
            )
        cos = self.rope_cos[:T].to(self.lm_head.weight.dtype)  # (T, hd/2)
        sin = self.rope_sin[:T].to(self.lm_head.weight.dtype)  # (T, hd/2)
        x = self.tok_embeddings(tokens)  # (B, T, D)
        for layer in self.layers:
            x = layer(x, cos, sin)  # (B, T, D)
        return cast(torch.Tensor, self.norm(x))  # (B, T, D)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``(B, T, V)``."""
        return cast(torch.Tensor, self.lm_head(self.hidden(tokens)))  # (B, T, V)


def tiny_llama(
    config: LlamaConfig | None = None, *, seed: int = 0, dtype: torch.dtype = torch.float32
) -> TinyLlama:
    """Build a :class:`TinyLlama` with seeded weights, leaving the global RNG untouched.

    Args:
        config: Sizes; the defaults of :class:`LlamaConfig` when None.
        seed: Seed for the weights.
        dtype: Parameter dtype.

    Returns:
        The model, in training mode.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = TinyLlama(config or LlamaConfig())
    return model.to(dtype)
