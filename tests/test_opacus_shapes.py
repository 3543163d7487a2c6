"""Layers at the shapes opacus' own per-sample-gradient tests use (``tests/grad_samples/``:
EmbeddingBag with offsets, RNN/GRU/LSTM on packed sequences, opacus' DPLSTM-style modules that
register one parameter under two names), each against the ``loop`` oracle in float64, for both
batch reductions, per-datum gradients and ``p.grad`` alike. opacus is not a dependency: its
layer layouts are rebuilt here."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from gradlog.errors import UnsupportedLayerError
from gradlog.testing.oracle import assert_like_loop, backend_grads

D64 = torch.float64


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _loss(y: torch.Tensor, seed: int = 1) -> torch.Tensor:
    """A non-linear loss per datum of any (B, ...) output: (B,)."""
    w = torch.randn(y.shape, generator=_gen(seed), dtype=y.dtype)  # (B, ...)
    return (torch.tanh(y) * w).reshape(y.shape[0], -1).sum(1)  # (B,)


def _built(factory: Callable[[], nn.Module]) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return factory().to(D64)


# -- EmbeddingBag --------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("mode", "weighted", "padding_idx", "last", "freq"),
    [("sum", False, None, False, False), ("mean", False, None, False, False),
     ("max", False, None, False, False), ("sum", True, None, False, False),
     ("mean", False, 2, True, False), ("max", False, 2, False, False),
     ("sum", True, 2, True, False)],
)
def test_embedding_bag_with_offsets_gives_each_bag_its_gradient(
        mode: str, weighted: bool, padding_idx: int | None, last: bool, freq: bool) -> None:
    """The standard call (1-D input, offsets): it crashed in the torch.func fallback
    ("offsets[0] has to be 0"). Bag 2 is empty; index 2 (padding) and repeats occur."""
    bag = _built(lambda: nn.EmbeddingBag(7, 3, mode=mode, padding_idx=padding_idx,
                                         include_last_offset=last, scale_grad_by_freq=freq))
    x = torch.tensor([1, 2, 2, 5, 0, 6, 6, 3, 4, 2, 1])
    offsets = torch.tensor([0, 3, 5, 5, 8] + ([11] if last else []))  # 5 bags, one empty
    psw = torch.rand(11, generator=_gen(3), dtype=D64) if weighted else None

    def forward() -> torch.Tensor:
        return _loss(bag(x, offsets, per_sample_weights=psw))  # (5,)

    described = assert_like_loop(bag, forward)
    assert described["fallback"] == []


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_embedding_bag_on_a_2d_input_splits_rows(mode: str) -> None:
    bag = _built(lambda: nn.EmbeddingBag(9, 4, mode=mode))
    x = torch.randint(0, 9, (4, 5), generator=_gen(2))  # (B, N): one bag per row
    psw = torch.rand(4, 5, generator=_gen(3), dtype=D64) if mode == "sum" else None
    assert_like_loop(bag, lambda: _loss(bag(x, per_sample_weights=psw)))


def test_embedding_bag_in_a_model() -> None:
    """Bags feeding a classifier, the usual text-classification layout."""

    class Classifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bag, self.head = nn.EmbeddingBag(11, 6), nn.Linear(6, 3)

        def forward(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
            return self.head(torch.relu(self.bag(x, offsets)))  # type: ignore[no-any-return]

    model = _built(Classifier)
    x = torch.randint(0, 11, (14,), generator=_gen(4))
    offsets = torch.tensor([0, 2, 7, 9])
    assert_like_loop(model, lambda: _loss(model(x, offsets)))


def test_embedding_bag_scale_grad_by_freq_is_refused_before_the_backward() -> None:
    bag = _built(lambda: nn.EmbeddingBag(7, 3, scale_grad_by_freq=True))
    x, offsets = torch.tensor([1, 2, 2, 5]), torch.tensor([0, 2])
    with pytest.raises(UnsupportedLayerError, match="scale_grad_by_freq"):
        backend_grads(bag, lambda: _loss(bag(x, offsets)))
    assert bag.weight.grad is None


# -- RNNs on packed sequences ----------------------------------------------------------------

_PACKED = [  # (class, batch_first, bidirectional, layers, with_state): one per class by default
    (nn.LSTM, False, True, 2, True), (nn.GRU, True, True, 1, True), (nn.RNN, True, False, 1, False),
    *(pytest.param(*case, marks=pytest.mark.slow) for case in [
        (nn.LSTM, True, False, 1, False), (nn.LSTM, True, True, 1, True),
        (nn.GRU, False, True, 2, True), (nn.GRU, True, False, 1, False),
        (nn.RNN, False, True, 2, True), (nn.RNN, True, True, 1, True)]),
]


@pytest.mark.parametrize(("cls", "batch_first", "bidirectional", "layers", "with_state"),
                         _PACKED)
def test_rnn_on_a_packed_sequence(cls: type[nn.RNNBase], batch_first: bool,
                                  bidirectional: bool, layers: int, with_state: bool) -> None:
    """opacus' packed-sequence cases: unsorted lengths, repeated lengths, the loss reading
    both the output sequence and the final state (it was refused: "not supported yet")."""
    rnn = _built(lambda: cls(3, 4, num_layers=layers, bidirectional=bidirectional,
                             batch_first=batch_first))
    B, T = 5, 6
    x = torch.randn(B, T, 3, generator=_gen(1), dtype=D64)
    lengths = torch.tensor([6, 2, 4, 2, 5])
    n_states = layers * (2 if bidirectional else 1)
    h0 = torch.randn(n_states, B, 4, generator=_gen(2), dtype=D64)
    w = torch.randn(B, T, 4 * (2 if bidirectional else 1), generator=_gen(3), dtype=D64)

    def forward() -> torch.Tensor:
        xs = x if batch_first else x.transpose(0, 1)
        packed = pack_padded_sequence(xs, lengths, batch_first=batch_first,
                                      enforce_sorted=False)
        hx = None if not with_state else (h0, 0.5 * h0) if cls is nn.LSTM else h0
        out, state = rnn(packed, hx)
        h_n = state[0] if isinstance(state, tuple) else state  # (layers*dirs, B, H)
        seq, _ = pad_packed_sequence(out, batch_first=True)  # (B, T_max, H*dirs)
        return (torch.tanh(seq) * w[:, : seq.shape[1]]).sum((1, 2)) + h_n.pow(2).sum((0, 2))

    described = assert_like_loop(rnn, forward)
    assert {m["rule"] for m in described["modules"]} == {"rnn"}


# -- one parameter under two names (opacus DPLSTM / DPGRU / DPRNN) --------------------------

class _Cell(nn.Module):
    """An RNN cell of two Linears (opacus' ``RNNLinear`` layout)."""

    def __init__(self, d_in: int, hidden: int) -> None:
        super().__init__()
        self.ih, self.hh = nn.Linear(d_in, hidden), nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.ih(x) + self.hh(h))


class _DPRNNLike(nn.Module):
    """opacus' DPRNN layout: the cell's weights registered again under torch's RNN names
    (``weight_ih_l0`` is ``cell.ih.weight``), so ``named_parameters()`` gives the top-level
    names."""

    def __init__(self, d_in: int = 3, hidden: int = 4, *, gain: bool = False) -> None:
        super().__init__()
        self.cell = _Cell(d_in, hidden)
        self.weight_ih_l0, self.bias_ih_l0 = self.cell.ih.weight, self.cell.ih.bias
        self.weight_hh_l0, self.bias_hh_l0 = self.cell.hh.weight, self.cell.hh.bias
        self.gain = nn.Parameter(torch.ones(hidden)) if gain else None
        self.hidden = hidden

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, d_in) -> (B, hidden)
        h = x.new_zeros(x.shape[0], self.hidden)
        for t in range(x.shape[1]):
            h = self.cell(x[:, t], h)
        return h * self.gain if self.gain is not None else h


class _AliasOnly(nn.Module):
    """A module without a rule holding a parameter under two names of its own and using it
    in its forward (the torch.func fallback used to fail: "functional_call got multiple
    values for keys ... which are tied")."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 3))
        self.register_parameter("weight_alias", self.weight)
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.weight_alias.T) * self.scale


@pytest.mark.parametrize("factory", [_DPRNNLike, lambda: _DPRNNLike(gain=True), _AliasOnly],
                         ids=["dprnn", "dprnn_with_own_param", "alias_in_forward"])
def test_a_parameter_registered_under_two_names(factory: Callable[[], nn.Module]) -> None:
    model = _built(factory)
    x = torch.randn(5, 3, 3, generator=_gen(1), dtype=D64)
    if isinstance(model, _AliasOnly):
        x = x[:, 0]
    assert_like_loop(model, lambda: _loss(model(x)))
    assert_like_loop(model, lambda m, b: _loss(m(b)), batch=x, backends=("vmap",))
