"""The hooks backend on a model zoo, end to end: recorded with ``GradRecorder`` (self-check on
every step), read back with ``gradlog.open``, compared with the loop oracle recorded the same
way; float64, both batch reductions."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import gradlog
from gradlog.testing.zoo import gpt_batch, per_token_ce, tiny_gpt

D64 = torch.float64
Forward = Callable[[nn.Module], tuple[torch.Tensor, torch.Tensor | None]]


def record(
    model: nn.Module,
    forward: Forward,
    backend: str,
    path: Path,
    reduction: str,
    params: str = "*",
    dtype: str = "float64",
) -> tuple[dict[str, np.ndarray], Any]:
    """Record one step; return the stored per-datum gradients and the run."""
    with gradlog.GradRecorder(
        model,
        path,
        backend=backend,
        batch_reduction=reduction,
        dtype=dtype,
        check_every=1,
        params=params,
    ) as rec:
        model.zero_grad(set_to_none=True)
        losses, mask = forward(model)
        rec.backward(losses, mask=mask)
    run = gradlog.open(path)
    return {n: run.grads(n, dtype=np.float64) for n in run.param_names}, run


def assert_zoo_model(
    model: nn.Module,
    forward: Forward,
    tmp_path: Path,
    *,
    params: str = "*",
    fallback: list[str] | None = None,
    rtol: float = 1e-6,
    dtype: str = "float64",
) -> None:
    for reduction in ("mean", "sum"):
        got, run = record(
            model, forward, "hooks", tmp_path / f"h-{reduction}.gradlog", reduction, params, dtype
        )
        want, _ = record(
            model, forward, "loop", tmp_path / f"l-{reduction}.gradlog", reduction, params, dtype
        )
        assert set(got) == set(want)
        for name in want:  # atol: k biases have exactly zero gradient (softmax shift), ~1e-20
            np.testing.assert_allclose(
                got[name], want[name], rtol=rtol, atol=rtol * 1e-6, err_msg=f"{name} ({reduction})"
            )
        described = run.attrs["backend"]
        assert described["name"] == "hooks"
        if fallback is not None:
            assert described["fallback"] == fallback


def seeded(factory: Callable[[], nn.Module], seed: int = 0) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return factory().to(D64)


def tokens(B: int, T: int, V: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, T), generator=gen), torch.randint(0, V, (B, T), generator=gen)


# -- transformers ----------------------------------------------------------------------------
@pytest.mark.parametrize("tied", [True, False])
def test_tiny_gpt_tied_broadcast_positions_padding(tmp_path: Path, tied: bool) -> None:
    model = tiny_gpt(tie_weights=tied, n_layer=2)
    x, y, mask = gpt_batch(5, 7)  # right padding in some rows; positions broadcast as [1, T]
    assert_zoo_model(model, lambda m: (per_token_ce(m(x), y), mask), tmp_path, fallback=[])


class NanoGPTStyle(nn.Module):
    """Position ids ``arange(T)`` without a batch dimension (nanoGPT), a tied head."""

    def __init__(self, V: int = 9, d: int = 6, T_max: int = 8) -> None:
        super().__init__()
        self.wte = nn.Embedding(V, d)
        self.wpe = nn.Embedding(T_max, d)
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, V, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1])  # (T,)
        return self.head(self.ln(self.wte(idx) + self.wpe(pos)))  # (B, T, V)


@pytest.mark.parametrize("T", [4, 6])  # T == B is the ambiguous case for shape heuristics
def test_nanogpt_style_unbatched_positions(tmp_path: Path, T: int) -> None:
    model = seeded(NanoGPTStyle)
    x, y = tokens(4, T, 9)
    assert_zoo_model(model, lambda m: (per_token_ce(m(x), y), None), tmp_path, fallback=[])


class AttentionClassifier(nn.Module):
    """Embedding, nn.MultiheadAttention with a key padding mask, LayerNorm, pooled head."""

    def __init__(self, V: int = 11, d: int = 8, batch_first: bool = True) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.emb = nn.Embedding(V, d, padding_idx=0)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=batch_first)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 3)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)  # (B, T, d)
        pad = idx == 0  # (B, T)
        if not self.batch_first:
            h = h.transpose(0, 1)  # (T, B, d)
        a, _ = self.attn(h, h, h, key_padding_mask=pad, need_weights=False)
        if not self.batch_first:
            a, h = a.transpose(0, 1), h.transpose(0, 1)
        h = self.norm(h + a)  # (B, T, d)
        keep = (~pad).unsqueeze(-1).to(h.dtype)  # (B, T, 1)
        return self.head((h * keep).sum(1) / keep.sum(1).clamp_min(1))  # (B, 3)


@pytest.mark.parametrize("batch_first", [True, False])
def test_multihead_attention_model(tmp_path: Path, batch_first: bool) -> None:
    model = seeded(lambda: AttentionClassifier(batch_first=batch_first))
    x, _ = tokens(4, 6, 11)
    x[0, -2:] = 0  # padding
    y = torch.tensor([0, 1, 2, 1])
    assert_zoo_model(
        model, lambda m: (F.cross_entropy(m(x), y, reduction="none"), None), tmp_path, fallback=[]
    )


@pytest.mark.parametrize("batch_first", [True, False])
def test_transformer_encoder_in_training_with_its_default_dropout(
        tmp_path: Path, batch_first: bool) -> None:
    """nn.TransformerEncoder in training with its default dropout (0.1; attention dropout
    drawn inside SDPA, which a per-datum re-run cannot draw again; refused before): its
    attention layers' records come from the batch's own backward, equal to the loop
    oracle's on the same masks (the forward seeded alike), with a causal mask and padding."""
    model = seeded(lambda: nn.TransformerEncoder(
        nn.TransformerEncoderLayer(8, 2, 16, batch_first=batch_first), 2,
        enable_nested_tensor=False)).train()
    x = torch.randn(3, 5, 8, dtype=D64, generator=torch.Generator().manual_seed(0))
    pad = torch.zeros(3, 5, dtype=torch.bool)
    pad[1, -2:] = True
    causal = nn.Transformer.generate_square_subsequent_mask(5, dtype=D64).isinf()

    def forward(m: nn.Module) -> tuple[torch.Tensor, None]:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1)  # the same dropout masks in every run
            h = m(x if batch_first else x.transpose(0, 1), mask=causal,
                  src_key_padding_mask=pad)
        h = h if batch_first else h.transpose(0, 1)
        return torch.tanh(h).sum((1, 2)), None

    assert_zoo_model(model, forward, tmp_path, fallback=[])


class Checkpointed(nn.Module):
    """Two encoder layers in training, each in a non-reentrant activation checkpoint."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(8, 2, 16, batch_first=True) for _ in range(2))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False)
        return self.head(x)


def test_attention_dropout_under_checkpoints_over_steps_on_one_input(tmp_path: Path) -> None:
    """A checkpoint's recompute draws the same masks and is not a second call of the layer;
    the same input tensor at every step is not either: three SGD steps, records equal the
    loop oracle's run on the same masks."""
    x = torch.randn(3, 5, 8, dtype=D64, generator=torch.Generator().manual_seed(0))
    stores = {}
    for backend in ("hooks", "loop"):
        model = seeded(Checkpointed).train()
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        path = tmp_path / f"{backend}.gradlog"
        with gradlog.GradRecorder(model, path, backend=backend, dtype="float64",
                                  check_every=1) as rec:
            for step in range(3):
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(step)
                    out = model(x)
                opt.zero_grad()
                rec.backward(torch.tanh(out).sum((1, 2)))
                opt.step()
        stores[backend] = gradlog.open(path)
    for name in stores["loop"].param_names:
        want = stores["loop"].grads(name, dtype=np.float64)
        np.testing.assert_allclose(stores["hooks"].grads(name, dtype=np.float64), want,
                                   rtol=1e-6, atol=1e-12, err_msg=name)


def test_transformer_encoder_layer(tmp_path: Path) -> None:
    model = seeded(lambda: nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True))
    x = torch.randn(3, 5, 8, dtype=D64, generator=torch.Generator().manual_seed(0))
    assert_zoo_model(model, lambda m: (torch.tanh(m(x)).sum((1, 2)), None), tmp_path, fallback=[])


# -- convolutional and recurrent -------------------------------------------------------------
def small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.GroupNorm(4, 8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=2),
        nn.GroupNorm(2, 8),
        nn.ReLU(),
        nn.Conv2d(8, 4, 1),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 5),
    )


def test_cnn_with_group_norm(tmp_path: Path) -> None:
    model = seeded(small_cnn)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, 8, 8, dtype=D64, generator=gen)
    y = torch.randint(0, 5, (4,), generator=gen)
    assert_zoo_model(
        model, lambda m: (F.cross_entropy(m(x), y, reduction="none"), None), tmp_path, fallback=[]
    )


class RecurrentLM(nn.Module):
    """Embedding -> 2-layer (LSTM | GRU) -> Linear head, batch first or sequence first."""

    def __init__(self, kind: str, batch_first: bool, V: int = 10, d: int = 6) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.emb = nn.Embedding(V, d)
        self.rnn = getattr(nn, kind)(d, d, num_layers=2, batch_first=batch_first)
        self.head = nn.Linear(d, V)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx if self.batch_first else idx.t())  # (B, T, d) or (T, B, d)
        out, _ = self.rnn(h)
        out = out if self.batch_first else out.transpose(0, 1)  # (B, T, d)
        return self.head(out)  # (B, T, V)


@pytest.mark.parametrize(("kind", "batch_first"), [("LSTM", True), ("GRU", False)])
def test_recurrent_language_models(tmp_path: Path, kind: str, batch_first: bool) -> None:
    model = seeded(lambda: RecurrentLM(kind, batch_first))
    x, y = tokens(3, 5, 10)
    assert_zoo_model(model, lambda m: (per_token_ce(m(x), y), None), tmp_path, fallback=[])


# -- adapters, raw parameters, reuse ---------------------------------------------------------
class LoRALinear(nn.Module):
    """A frozen Linear plus a trainable low-rank update ``B A x * alpha / r`` (PEFT style)."""

    def __init__(self, d_in: int, d_out: int, r: int = 2, alpha: float = 4.0) -> None:
        super().__init__()
        self.base = nn.Linear(d_in, d_out)
        self.base.requires_grad_(False)
        self.lora_A = nn.Linear(d_in, r, bias=False)
        self.lora_B = nn.Linear(r, d_out, bias=False)
        nn.init.normal_(self.lora_B.weight, std=0.1)  # PEFT starts at 0; keep it generic
        self.scaling = alpha / r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_B(self.lora_A(x)) * self.scaling


def test_lora_adapters_on_frozen_linear_layers(tmp_path: Path) -> None:
    model = seeded(lambda: nn.Sequential(LoRALinear(6, 8), nn.GELU(), LoRALinear(8, 4)))
    x = torch.randn(4, 3, 6, dtype=D64, generator=torch.Generator().manual_seed(0))
    assert_zoo_model(model, lambda m: (torch.tanh(m(x)).sum((1, 2)), None), tmp_path, fallback=[])
    _, run = record(
        model,
        lambda m: (torch.tanh(m(x)).sum((1, 2)), None),
        "hooks",
        tmp_path / "only.gradlog",
        "mean",
    )
    assert all("lora" in n for n in run.param_names)  # the frozen base is not recorded


class TinyViT(nn.Module):
    """Raw parameters in the parent's forward: a class token and position embedding."""

    def __init__(self, d: int = 6, patches: int = 4) -> None:
        super().__init__()
        self.patch = nn.Linear(5, d)
        self.cls = nn.Parameter(torch.randn(1, 1, d))
        self.pos = nn.Parameter(torch.randn(1, patches + 1, d) * 0.1)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.patch(x)  # (B, P, d)
        cls = self.cls.expand(h.shape[0], -1, -1)  # (B, 1, d)
        h = torch.cat([cls, h], dim=1) + self.pos  # (B, P+1, d)
        return self.head(self.norm(h)[:, 0])  # (B, 3)


def test_raw_parameters_in_the_parents_forward(tmp_path: Path) -> None:
    model = seeded(TinyViT)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 4, 5, dtype=D64, generator=gen)
    y = torch.randint(0, 3, (4,), generator=gen)
    assert_zoo_model(
        model, lambda m: (F.cross_entropy(m(x), y, reduction="none"), None), tmp_path, fallback=[""]
    )  # the model itself owns cls and pos


class _NoisyViT(TinyViT):
    """TinyViT with dropout on the embeddings, a functional one and a layer, and a scale
    parameter of the root's used after the norm (timm's and CLIP's own parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 6))
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.patch(x)
        h = torch.cat([self.cls.expand(h.shape[0], -1, -1), h], dim=1) + self.pos
        h = self.drop(F.dropout(h, 0.2, self.training))
        return self.head(self.norm(h)[:, 0] * self.scale.exp())  # type: ignore[no-any-return]


def test_a_roots_own_parameters_with_dropout_record_like_the_loop() -> None:
    """The root's own parameters beside hooked layers: the model is re-run per datum for
    them, its functional and layer dropouts replayed (the functional one was refused)."""
    from gradlog.testing.oracle import assert_like_loop

    model = seeded(_NoisyViT).train()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 4, 5, dtype=D64, generator=gen)
    y = torch.randint(0, 3, (6,), generator=gen)
    described = assert_like_loop(model, lambda: F.cross_entropy(model(x), y, reduction="none"))
    assert described["fallback"] == [""]


class _Temperature(nn.Module):
    """A Linear and a 0-d parameter held by a submodule never called (so op-level capture
    takes its uses) used twice: as a scale of the outputs and of their (B, 1) sums (a
    per-datum tensor broadcast over features, not over the batch); or (``"summed"``,
    ``"gumbel"``) a parameter through deterministic or random functions of it alone."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.lin, self.kind = nn.Linear(4, 4), kind
        self.held = nn.ParameterDict({"temp": nn.Parameter(torch.tensor(0.3)),
                                      "logits": nn.Parameter(torch.linspace(-1.0, 1.0, 4))})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, temp, logits = self.lin(x), self.held["temp"], self.held["logits"]
        if self.kind == "gumbel":
            return h * F.gumbel_softmax(logits, tau=1.0)
        if self.kind == "summed":  # (functions of it alone that make fewer elements)
            return h * logits.cumsum(0).sum().tanh() + h.mean(-1, keepdim=True)
        return h * temp + temp * h.sum(-1, keepdim=True)  # type: ignore[no-any-return]


@pytest.mark.parametrize("kind", ["twice", "summed"])
def test_a_per_datum_op_output_broadcast_over_features_is_not_shared(kind: str) -> None:
    """``temp * h.sum(-1, keepdim=True)`` (B, 1), added to (B, 4): it was taken for an
    output shared by the batch and broadcast to it, and the per-op rule failed ("shape
    '[3, 3, 1]' is invalid", please report); its batch is its own. And a sum of a parameter
    alone (``"summed"``) is a step of its use, as its shape-keeping functions are."""
    from gradlog.testing.oracle import assert_like_loop

    model = seeded(lambda: _Temperature(kind))
    x = torch.randn(3, 4, dtype=D64, generator=torch.Generator().manual_seed(0))
    assert_like_loop(model, lambda: model(x).pow(2).sum(-1))


class _ClassTable(nn.Module):
    """A class-conditional scale: a table held by a submodule never called, indexed by each
    datum's label inside a tuple (``W[y, :]``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.held = nn.ParameterDict({"W": nn.Parameter(torch.randn(5, 4))})

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.held["W"][y, :]  # type: ignore[no-any-return]


def test_a_parameter_indexed_by_data_inside_a_tuple_is_an_op_of_its_own() -> None:
    """``W[y, :]``: the index tensor sits in a tuple, so the indexing was taken for a view
    of the parameter alone, its value baked with this batch's labels; at B > 1 the per-op
    rule failed (an internal error, please report)."""
    from gradlog.testing.oracle import assert_like_loop

    model = seeded(_ClassTable)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(3, 4, dtype=D64, generator=gen), torch.tensor([0, 2, 2])
    assert_like_loop(model, lambda: model(x, y).pow(2).sum(-1))


def test_a_random_function_of_a_parameter_alone_is_not_replayed() -> None:
    """A function of one parameter that draws random numbers (``gumbel_softmax``) is no step
    of its use (a replay would draw again): an op on parameters alone, refused."""
    from gradlog.errors import BackendError
    from gradlog.testing.oracle import backend_grads

    model = seeded(lambda: _Temperature("gumbel"))
    x = torch.randn(3, 4, dtype=D64, generator=torch.Generator().manual_seed(0))
    with pytest.raises(BackendError, match="operation on parameters alone"):
        backend_grads(model, lambda: model(x).pow(2).sum(-1))


class Reuse(nn.Module):
    """One Linear applied twice (weight reuse) and a tied embedding/head."""

    def __init__(self, V: int = 7, d: int = 5) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, d)
        self.mix = nn.Linear(d, d)
        self.head = nn.Linear(d, V, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)  # (B, T, d)
        h = h + torch.tanh(self.mix(h))
        h = h + torch.tanh(self.mix(h))  # the same module again
        return self.head(h)  # (B, T, V)


def test_module_reuse_and_tied_weights(tmp_path: Path) -> None:
    model = seeded(Reuse)
    x, y = tokens(4, 5, 7)
    assert_zoo_model(model, lambda m: (per_token_ce(m(x), y), None), tmp_path, fallback=[])


def test_float32_gpt(tmp_path: Path) -> None:
    model = tiny_gpt(tie_weights=True, dtype=torch.float32)
    x, y, mask = gpt_batch(4, 6)
    assert_zoo_model(
        model, lambda m: (per_token_ce(m(x), y), mask), tmp_path, rtol=2e-4, dtype="float32"
    )


def test_recording_a_few_layers_of_a_larger_model(tmp_path: Path) -> None:
    model = tiny_gpt(n_layer=3)
    x, y, mask = gpt_batch(4, 6)
    assert_zoo_model(
        model, lambda m: (per_token_ce(m(x), y), mask), tmp_path, params="blocks.1.mlp.*"
    )
    _, run = record(
        model,
        lambda m: (per_token_ce(m(x), y), mask),
        "hooks",
        tmp_path / "few.gradlog",
        "mean",
        params="blocks.1.mlp.*",
    )
    hooked = {m["module"] for m in run.attrs["backend"]["modules"]}
    assert hooked == {"blocks.1.mlp.fc", "blocks.1.mlp.proj"}
    assert math.isfinite(float(np.asarray(run.datums.column("loss")).sum()))


# -- Llama-style model, and the memory-efficient chunked LM head -----------------------------
def test_tiny_llama_rmsnorm_rotary_swiglu(tmp_path: Path) -> None:
    llama = pytest.importorskip("gradlog.testing.llama")
    config = llama.LlamaConfig(
        vocab_size=17, dim=8, n_layers=2, n_heads=2, hidden_dim=12, max_seq_len=8
    )
    model = llama.tiny_llama(config, dtype=D64)
    x, y = tokens(3, 6, 17)
    assert_zoo_model(model, lambda m: (per_token_ce(m(x), y), None), tmp_path, fallback=[])


# rows of (B, T) = (3, 6): chunks inside one datum (2), splitting datums at any offset (4, 7,
# [1, 10, 7]), of whole datums (12), or all rows (18)
@pytest.mark.parametrize("chunk_size", [2, 4, 7, 12, 18, [1, 10, 7]])
def test_chunked_lm_head_rows_are_attributed_to_datums(
    tmp_path: Path, chunk_size: int | list[int]
) -> None:
    llama = pytest.importorskip("gradlog.testing.llama")
    memory = pytest.importorskip("gradlog.memory")
    config = llama.LlamaConfig(
        vocab_size=17, dim=8, n_layers=1, n_heads=2, hidden_dim=12, max_seq_len=8
    )
    model = llama.tiny_llama(config, dtype=D64)
    x, y = tokens(3, 6, 17)
    y[0, -2:] = -100  # ignored rows

    def ce(h: torch.Tensor, head: nn.Module, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(head(h), labels, reduction="none")  # (rows,)

    def forward(m: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        losses = memory.chunked_linear_loss(
            m.hidden(x), m.lm_head, y, ce, reduction="none", chunk_size=chunk_size
        )  # (B, T)
        return losses, y != -100

    assert_zoo_model(model, forward, tmp_path, fallback=[])
