"""PEFT adapters that build a weight or a scaling from their parameters alone (IA3, LoHa,
LoKr, BOFT, AdaLoRA, FourierFT, HRA, VB-LoRA, RandLoRA, C3A; ``gradlog/rules/adapters.py``)
and DoRA, on the hooks backend, against a float64 oracle of one ``autograd.grad`` per datum
through the batch's own forward (same dropout masks: the forward is seeded alike).

Models: a plain-torch toy LM (pure float64: tolerance 1e-9) and a tiny Llama (its RMSNorm
computes in float32 even in a float64 model: 1e-6), several batch sizes and sequence
lengths, right padding with attention masks and -100 labels, mean and sum batch losses, and
a two-step AdamW loop through ``GradRecorder`` read back from the store.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradlog
from gradlog.testing.oracle import backend_grads

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings(  # peft's, not gradlog's
    "ignore::FutureWarning", "ignore:Failed to load the CUDA extension:UserWarning",
    "ignore:Setting boft_n_butterfly_factor:UserWarning", "ignore:fan_in_fan_out:UserWarning")

D64 = torch.float64
V, H = 50, 32
TGT = ["q_proj", "v_proj", "down_proj"]

CONFIGS: dict[str, Callable[[], Any]] = {
    "ia3": lambda: peft.IA3Config(target_modules=TGT, feedforward_modules=["down_proj"]),
    "loha": lambda: peft.LoHaConfig(r=4, alpha=8, target_modules=TGT),
    "lokr": lambda: peft.LoKrConfig(r=4, alpha=8, target_modules=TGT),
    "boft": lambda: peft.BOFTConfig(boft_block_size=4, target_modules=TGT),
    "adalora": lambda: peft.AdaLoraConfig(init_r=4, target_r=2, target_modules=TGT,
                                          total_step=10, lora_dropout=0.1),
    "dora": lambda: peft.LoraConfig(r=4, lora_alpha=8, target_modules=TGT, use_dora=True,
                                    lora_dropout=0.1),
    "fourierft": lambda: peft.FourierFTConfig(n_frequency=20, target_modules=TGT),
    "hra": lambda: peft.HRAConfig(r=2, target_modules=TGT),
    "vblora": lambda: peft.VBLoRAConfig(r=4, num_vectors=16, vector_length=8,
                                        target_modules=TGT),
    "randlora": lambda: peft.RandLoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
    "c3a": lambda: peft.C3AConfig(block_size=8, target_modules=TGT),
}
LOOSE = {"c3a": 1e-6, "fourierft": 1e-6}  # these compute their deltas in float32 (FFTs)


class Toy(nn.Module):
    """A plain-torch LM with the Llama projection names."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.q_proj, self.v_proj = nn.Linear(H, H), nn.Linear(H, H)
        self.up, self.down_proj = nn.Linear(H, 64), nn.Linear(64, H)
        self.ln, self.lm_head = nn.LayerNorm(H), nn.Linear(H, V)

    def forward(self, input_ids: torch.Tensor, attention_mask: Any = None) -> torch.Tensor:
        h = self.emb(input_ids)
        h = h + self.v_proj(torch.tanh(self.q_proj(h)))
        h = h + self.down_proj(F.gelu(self.up(h)))
        return self.lm_head(self.ln(h))  # type: ignore[no-any-return]


def _base(family: str) -> nn.Module:
    torch.manual_seed(0)
    if family == "toy":
        return Toy().to(D64)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg).to(D64)  # type: ignore[no-any-return]


def _wrap(base: nn.Module, config: Any) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        model = peft.get_peft_model(base, config)
        with torch.no_grad():  # away from the initialisation (LoRA B = 0, IA3 = 1, ...)
            for p in model.parameters():
                if p.requires_grad:
                    p.add_(0.05 * torch.randn_like(p))
    return model.to(D64).train()  # type: ignore[no-any-return]


def _batch(B: int, T: int, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    for b in range(1, B, 2):  # every other datum right-padded, by varying amounts
        mask[b, T - 1 - (b % (T - 1)):] = 0
    return {"ids": ids, "mask": mask}


def _losses(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each sequence's mean next-token loss over its unpadded tokens: (B,)."""
    ids, mask = batch["ids"], batch["mask"]
    out = model(input_ids=ids, attention_mask=mask)
    logits = (out.logits if hasattr(out, "logits") else out)[:, :-1]
    labels = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    keep = labels != -100
    per_token = F.cross_entropy(logits.transpose(1, 2), labels.clamp_min(0), reduction="none")
    return (per_token * keep).sum(1) / keep.sum(1).clamp_min(1)


def _oracle(model: nn.Module, batch: dict[str, torch.Tensor], seed: int = 0,
            scale: float = 1.0) -> dict[str, torch.Tensor]:
    """One autograd.grad per datum through the batch's forward (seeded as backend_grads)."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        losses = _losses(model, batch)
    out = {n: torch.zeros(len(losses), *p.shape, dtype=D64) for n, p in params.items()}
    for b in range(len(losses)):
        got = torch.autograd.grad(losses[b], list(params.values()), retain_graph=True,
                                  allow_unused=True)
        for n, g in zip(params, got):
            if g is not None:
                out[n][b] = g * scale
    return out


def _assert_close(got: dict[str, Any], want: dict[str, torch.Tensor], rtol: float) -> float:
    assert set(got) == set(want)
    worst = 0.0
    for n, w in want.items():
        err = ((got[n].to(D64) - w).abs().max() / w.abs().max().clamp_min(1e-300)).item()
        assert w.abs().max() > 0, f"{n}: the oracle's gradient is zero (a vacuous test)"
        assert err <= rtol, f"{n}: max error {err:.3g} of its largest entry"
        worst = max(worst, err)
    return worst


def _shapes() -> list[Any]:
    """Every method on the toy at (3, 7) in the default suite (~1 s each); the Llama and the
    other shapes (B 1; T < B) are slow."""
    slow = pytest.mark.slow
    return [pytest.param(f, b, t, marks=() if (f, b, t) == ("toy", 3, 7) else slow)
            for f in ("toy", "llama") for b, t in ((1, 5), (3, 7), (5, 4))]


@pytest.mark.parametrize("method", list(CONFIGS))
@pytest.mark.parametrize(("family", "B", "T"), _shapes())
def test_hooks_equal_the_oracle(method: str, family: str, B: int, T: int) -> None:
    model = _wrap(_base(family), CONFIGS[method]())
    batch = _batch(B, T)
    rtol = LOOSE.get(method, 1e-9 if family == "toy" else 1e-6)
    for reduction in ("mean", "sum"):
        got, grads, described = backend_grads(model, lambda: _losses(model, batch), "hooks",
                                               reduction)
        want = _oracle(model, batch)
        _assert_close(got, want, rtol)
        w = 1 / B if reduction == "mean" else 1.0  # p.grad: the ordinary backward's, untouched
        assert all(grads[n] is not None for n in want)
        _assert_close({n: grads[n] for n in want}, {n: g.sum(0) * w for n, g in want.items()},
                      rtol)  # (errors relative to each parameter's largest entry)
    if method not in ("dora",):
        rules = {m["rule"] for m in described["modules"]}
        assert any(r.startswith("peft_") for r in rules), rules


@pytest.mark.parametrize("method", ["ia3", "loha", "lokr", "boft", "adalora"])
def test_two_adamw_steps_through_the_recorder(tmp_path: Path, method: str) -> None:
    model = _wrap(_base("llama"), CONFIGS[method]())
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    wants = []
    with gradlog.GradRecorder(model, tmp_path / "r.gradlog", optimizer=opt, dtype="float64",
                              check_every=1) as rec:
        for step in range(2):
            batch = _batch(4, 6, seed=step + 1)
            torch.manual_seed(100 + step)  # the oracle and the recorded forward: same masks
            wants.append(_oracle(model, batch, seed=100 + step))
            torch.manual_seed(100 + step)
            rec.backward(_losses(model, batch))
            opt.step()
            opt.zero_grad()
    run = gradlog.open(tmp_path / "r.gradlog")
    for step, want in enumerate(wants):
        got = {n: torch.as_tensor(run.grads(n, step=step)) for n in want}
        _assert_close(got, want, 1e-6)  # (reads are float32)


def test_ia3_on_gpt2_conv1d_with_feedforward_and_padding() -> None:
    cfg = transformers.GPT2Config(vocab_size=V, n_embd=H, n_layer=2, n_head=4, n_positions=32,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    base = transformers.GPT2LMHeadModel(cfg).to(D64)
    model = _wrap(base, peft.IA3Config(target_modules=["c_attn", "c_fc", "mlp.c_proj"],
                                       feedforward_modules=["mlp.c_proj"]))
    batch = _batch(4, 6)
    got, _, _ = backend_grads(model, lambda: _losses(model, batch), "hooks", "mean")
    _assert_close(got, _oracle(model, batch), 1e-9)


def test_ia3_with_two_active_adapters() -> None:
    model = _wrap(_base("toy"), CONFIGS["ia3"]())
    model.add_adapter("other", CONFIGS["ia3"]())
    model.base_model.set_adapter(["default", "other"])
    for n, p in model.named_parameters():
        if "ia3_l" in n:
            p.requires_grad_(True)
            with torch.no_grad():
                p.add_(0.05 * torch.randn_like(p))
    batch = _batch(3, 5)
    got, _, _ = backend_grads(model, lambda: _losses(model, batch), "hooks", "mean")
    _assert_close(got, _oracle(model, batch), 1e-9)


@pytest.mark.parametrize("method,config", [
    ("loha", lambda: peft.LoHaConfig(r=4, target_modules=TGT, module_dropout=0.1)),
    ("lokr", lambda: peft.LoKrConfig(r=4, target_modules=TGT, rank_dropout=0.1)),
    ("boft", lambda: peft.BOFTConfig(boft_block_size=4, target_modules=TGT,
                                     boft_dropout=0.1)),
])
def test_random_adapter_dropout_is_refused(tmp_path: Path, method: str,
                                           config: Callable[[], Any]) -> None:
    model = _wrap(_base("toy"), config())
    batch = _batch(3, 5)
    with gradlog.GradRecorder(model, tmp_path / "r.gradlog") as rec, pytest.raises(
            gradlog.errors.BackendError, match="at random in training mode"):
        rec.backward(_losses(model, batch))


def test_with_those_rates_in_eval_mode_it_records() -> None:
    model = _wrap(_base("toy"), peft.LoHaConfig(r=4, target_modules=TGT, module_dropout=0.1))
    model.eval()
    batch = _batch(3, 5)
    got, _, _ = backend_grads(model, lambda: _losses(model, batch), "hooks", "mean")
    _assert_close(got, _oracle(model, batch), 1e-9)


def test_training_rng_stream_is_unchanged_by_the_re_runs() -> None:
    """LoHa draws torch.rand(1) in training; the re-run must not draw (eval path)."""
    model = _wrap(_base("toy"), CONFIGS["loha"]())
    batch = _batch(3, 5)
    torch.manual_seed(7)
    _losses(model, batch).mean().backward()
    after_plain = torch.rand(3)
    model.zero_grad()
    from gradlog.backends import BACKENDS
    from gradlog.params import select_params
    be = BACKENDS["hooks"](model, select_params(model, ["*"]), batch_reduction="mean",
                           randomness="different")
    be.attach()
    try:
        torch.manual_seed(7)
        losses = _losses(model, batch)
        be.backward(losses, be.reduce_batch(losses))
        after_hooks = torch.rand(3)
    finally:
        be.detach()
    torch.testing.assert_close(after_hooks, after_plain, rtol=0, atol=0)
