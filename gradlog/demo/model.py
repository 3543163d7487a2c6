"""A small character-level GPT (nanoGPT style, pre-LayerNorm) for gradlog demos and tests.

Design choices that matter for per-sample gradient tooling:

* Every weight matrix is a plain :class:`torch.nn.Linear` (separate ``q``, ``k``, ``v`` and
  ``proj`` layers, no fused ``qkv``), so hook-based per-sample gradient backends see only
  ``Linear``, ``Embedding`` and ``LayerNorm`` modules.
* Attention is written with explicit matmuls, a causal mask and softmax instead of
  ``F.scaled_dot_product_attention``, so ``torch.func.vmap`` works on every torch version.
* When ``position_ids`` is not given, the model uses Hugging Face style broadcast ids of
  shape ``(1, T)``. This is deliberate: the position embedding is then computed once and
  broadcast over the batch, a known trap for per-sample gradient tools.
* There is no BatchNorm, so samples in a batch never interact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MLP", "Block", "CausalSelfAttention", "CharGPT", "GPTConfig"]


@dataclass(frozen=True)
class GPTConfig:
    """Hyperparameters of :class:`CharGPT`.

    Attributes:
        vocab_size: Number of distinct tokens (characters).
        block_size: Maximum sequence length ``T`` the model accepts.
        n_layer: Number of transformer blocks.
        n_head: Number of attention heads per block.
        n_embd: Embedding width ``d``; must be divisible by ``n_head``.
        tie_weights: If True, the output head shares its weight with the token embedding.
        dropout: Dropout probability used in attention and MLP (0 disables it).
    """

    vocab_size: int
    block_size: int
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 48
    tie_weights: bool = False
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(
                    f"GPTConfig.{name} must be a positive int, got {value!r}; "
                    f"pass {name}=<int >= 1>."
                )
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}); "
                "choose n_embd as a multiple of n_head."
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(
                f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}; "
                "use dropout=0.0 to disable it."
            )


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with separate ``q``, ``k``, ``v``, ``proj`` layers."""

    causal_mask: torch.Tensor  # (Tmax, Tmax) bool buffer

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        d = config.n_embd
        self.n_head = config.n_head
        self.head_dim = d // config.n_head
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)
        self.proj = nn.Linear(d, d)
        self.attn_drop = nn.Dropout(config.dropout)
        self.resid_drop = nn.Dropout(config.dropout)
        # Lower-triangular causal mask, True where attention is allowed.
        mask = torch.ones(config.block_size, config.block_size, dtype=torch.bool).tril()
        self.register_buffer("causal_mask", mask, persistent=False)  # (Tmax, Tmax)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply attention.

        Args:
            x: Input of shape ``(B, T, d)``.

        Returns:
            Tensor of shape ``(B, T, d)``.
        """
        B, T, d = x.shape
        h, hd = self.n_head, self.head_dim
        q = self.q(x).view(B, T, h, hd).transpose(1, 2)  # (B, h, T, hd)
        k = self.k(x).view(B, T, h, hd).transpose(1, 2)  # (B, h, T, hd)
        v = self.v(x).view(B, T, h, hd).transpose(1, 2)  # (B, h, T, hd)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(hd)  # (B, h, T, T)
        mask = self.causal_mask[:T, :T]  # (T, T)
        att = att.masked_fill(~mask, float("-inf"))  # (B, h, T, T)
        att = F.softmax(att, dim=-1)  # (B, h, T, T)
        att = self.attn_drop(att)
        y = att @ v  # (B, h, T, hd)
        y = y.transpose(1, 2).reshape(B, T, d)  # (B, T, d)
        out: torch.Tensor = self.resid_drop(self.proj(y))  # (B, T, d)
        return out


class MLP(nn.Module):
    """Position-wise feed-forward network: ``fc`` (d -> 4d), GELU, ``proj`` (4d -> d)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        d = config.n_embd
        self.fc = nn.Linear(d, 4 * d)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MLP to ``x`` of shape ``(B, T, d)``; returns ``(B, T, d)``."""
        out: torch.Tensor = self.drop(self.proj(self.act(self.fc(x))))  # (B, T, d)
        return out


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block to ``x`` of shape ``(B, T, d)``; returns ``(B, T, d)``."""
        x = x + self.attn(self.ln1(x))  # (B, T, d)
        x = x + self.mlp(self.ln2(x))  # (B, T, d)
        return x


class CharGPT(nn.Module):
    """A small decoder-only transformer over characters.

    Args:
        config: Model hyperparameters.

    Example:
        >>> cfg = GPTConfig(vocab_size=65, block_size=32)
        >>> model = CharGPT(cfg)
        >>> logits = model(torch.zeros(2, 16, dtype=torch.long))  # (2, 16, 65)
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        d, V = config.n_embd, config.vocab_size
        self.tok_emb = nn.Embedding(V, d)
        self.pos_emb = nn.Embedding(config.block_size, d)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, V, bias=False)
        self.apply(self._init_weights)
        if config.tie_weights:
            # Share one Parameter between the input embedding and the output head.
            self.head.weight = self.tok_emb.weight

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        """Initialise weights deterministically (given the torch RNG state).

        Linear and Embedding weights get ``normal(0, 0.02)``, biases get zeros; LayerNorm
        keeps its default (weight 1, bias 0).
        """
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Compute next-token logits.

        Args:
            idx: Token ids of shape ``(B, T)`` with ``T <= block_size``.
            position_ids: Optional position ids broadcastable to ``(B, T)``. Defaults to
                ``arange(T)`` of shape ``(1, T)``, broadcast over the batch (Hugging Face
                style).

        Returns:
            Logits of shape ``(B, T, vocab_size)``.

        Raises:
            ValueError: If ``T`` exceeds ``config.block_size``.
        """
        seq_len = idx.shape[-1]  # T
        if seq_len > self.config.block_size:
            raise ValueError(
                f"CharGPT got a sequence of length T={seq_len}, but block_size is "
                f"{self.config.block_size}; truncate the input or build the model with a "
                "larger GPTConfig.block_size."
            )
        if position_ids is None:
            # Deliberately (1, T), broadcast over the batch, as in Hugging Face models.
            position_ids = torch.arange(seq_len, device=idx.device).unsqueeze(0)  # (1, T)
        x = self.tok_emb(idx) + self.pos_emb(position_ids)  # (B, T, d)
        x = self.drop(x)
        for block in self.blocks:
            x = block(x)  # (B, T, d)
        x = self.ln_f(x)  # (B, T, d)
        logits: torch.Tensor = self.head(x)  # (B, T, V)
        return logits
