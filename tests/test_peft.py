"""PEFT LoRA adapters on a small Llama (attention, MLP, ``embed_tokens`` with its
``ParameterDict`` adapters, ``lm_head``), in training mode with LoRA dropout: the default backend
against the ``loop`` oracle, and the vmap backend at step 0, where every LoRA A gradient is
exactly zero (B starts at zero) yet the loss depends on A."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradlog
from gradlog.testing.oracle import assert_like_loop

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

# peft 0.21 reads transformers' deprecated is_gradient_checkpointing (transformers 5)
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")

D64 = torch.float64
B, T, V = 3, 6, 40
TARGETS = {"attention": ["q_proj", "v_proj"], "mlp": ["gate_proj", "down_proj"],
           "embed_tokens": ["embed_tokens"], "lm_head": ["lm_head"]}


def _llama() -> nn.Module:
    """A one-layer float64 Llama with random weights (seed 0)."""
    config = transformers.LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, max_position_embeddings=32)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(D64)  # type: ignore[no-any-return]


def _model(targets: list[str], *, trained: bool) -> nn.Module:
    """A LoRA-wrapped one-layer Llama; ``trained``: LoRA B drawn non-zero (as after some
    steps), else as PEFT initialises it (B = 0)."""
    with torch.random.fork_rng(devices=[]):
        base = _llama()
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.1)
        model = peft.get_peft_model(base, lora)
        if trained:
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if "lora_B" in name or "lora_embedding_B" in name:
                        p.normal_(0.0, 0.1)
    return model.train()  # type: ignore[no-any-return]


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(1, V, (B, T), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 4:] = 0
    return {"ids": ids, "mask": mask}


def _losses(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each sequence's mean next-token loss over its labelled tokens: (B,)."""
    labels = batch["ids"].masked_fill(batch["mask"] == 0, -100)[:, 1:]  # (B, T-1)
    keep = labels != -100
    logits = model(input_ids=batch["ids"], attention_mask=batch["mask"]).logits[:, :-1]
    per_token = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
    return (per_token * keep).sum(1) / keep.sum(1).clamp_min(1)  # (B,)


def _forward(model: nn.Module) -> Callable[[], torch.Tensor]:
    batch = _batch()
    return lambda: _losses(model, batch)


def test_lora_everywhere_records_like_the_loop_oracle() -> None:
    """Adapters on attention, MLP, embed_tokens and lm_head at once."""
    model = _model([t for ts in TARGETS.values() for t in ts], trained=True)
    recorded = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("lora_embedding_A" in n for n in recorded) and len(recorded) == 12
    assert_like_loop(model, _forward(model), rtol=1e-4, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("where", list(TARGETS))
@pytest.mark.parametrize("trained", [False, True], ids=["step0", "trained"])
def test_lora_on_each_target(where: str, trained: bool) -> None:
    model = _model(TARGETS[where], trained=trained)
    assert_like_loop(model, _forward(model), reductions=("mean",), rtol=1e-4, atol=1e-6)


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(5, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))  # type: ignore[no-any-return]


def _mlp_losses(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch["x"]), batch["y"], reduction="none")  # (B,)


def test_vmap_at_step_0_records_zero_gradients_and_leaves_zero_grads(tmp_path: Path) -> None:
    """LoRA A's per-datum gradients are all exactly zero at step 0 (B = 0); vmap took A as
    unused, left .grad None (AdamW would then skip its weight decay) and refused it. (A
    plain-torch base model: Hugging Face's mask building is data-dependent, which vmap
    refuses.)"""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        base = _MLP().to(D64)
        model = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["up", "down"]))
    gen = torch.Generator().manual_seed(1)
    batch = {"x": torch.randn(4, 5, generator=gen, dtype=D64), "y": torch.tensor([0, 2, 1, 2])}
    plain = copy.deepcopy(model)
    _mlp_losses(plain, batch).mean().backward()
    with gradlog.GradRecorder(model, tmp_path / "r.gradlog", backend="vmap") as rec:
        rec.step(_mlp_losses, batch)
    grads: dict[str, Any] = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    for name, p in plain.named_parameters():
        if not p.requires_grad:
            continue
        assert grads[name] is not None, name
        torch.testing.assert_close(grads[name], p.grad)
    run = gradlog.open(tmp_path / "r.gradlog")
    a = [n for n in run.param_names if "lora_A" in n]
    assert len(a) == 2 and all(not run.grads(n, step=0).any() for n in a)
    assert all(run.grads(n, step=0).any() for n in run.param_names if "lora_B" in n)


@pytest.mark.parametrize("virtual", [B, B + 1])
def test_prompt_tuning_records_like_the_loop_and_is_verified(tmp_path: Path,
                                                             virtual: int) -> None:
    """PEFT's prompt embedding is computed once, ``(1, n, d)``, then repeated over the batch:
    each datum's gradient is its copy's (it was refused). With ``n == B`` its second
    dimension once passed for the batch, caught only by the step-0 datum check; a repeat's
    copies are read as the datums' only once that check passed on the layout, so where it
    cannot run (a module backward hook) the step is refused."""
    model = peft.get_peft_model(_llama(), peft.PromptTuningConfig(
        task_type="CAUSAL_LM", num_virtual_tokens=virtual)).to(D64).train()
    ids = _batch()["ids"]

    def losses() -> torch.Tensor:
        logits = model(input_ids=ids).logits[:, -T:][:, :-1]
        return F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none").mean(1)

    described = assert_like_loop(model, losses, rtol=1e-4, atol=1e-6)
    assert described["fallback"] == []
    model.base_model.lm_head.register_full_backward_hook(lambda *_: None)  # no datum check
    refused = pytest.raises(gradlog.errors.UnsupportedLayerError, match=r"a repeat copies")
    with gradlog.GradRecorder(model, tmp_path / "r.gradlog", dtype="float64") as rec, refused:
        rec.backward(losses())


def test_lora_on_debertas_attention_records_like_the_loop_oracle() -> None:
    """LoRA on DeBERTa-v3's query and value projections (PEFT's default targets): the query
    projection also takes the relative position table, shared by the batch, and its LoRA
    output, scaled and added to the frozen layer's, is repeated over the batch; each
    datum's gradient is taken back through the scaling and the addition (refused before)."""
    config = transformers.DebertaV2Config(
        vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=32, num_labels=2,
        hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, pooler_dropout=0.1,
        pooler_hidden_size=16, relative_attention=True, position_buckets=8,
        max_relative_positions=16, pos_att_type=["p2c", "c2p"], norm_rel_ebd="layer_norm",
        share_att_key=True)
    config._attn_implementation = "eager"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        base = transformers.DebertaV2ForSequenceClassification(config)
        model = peft.get_peft_model(base, peft.LoraConfig(
            r=2, target_modules=["query_proj", "value_proj"], lora_dropout=0.1,
            task_type="SEQ_CLS")).to(D64).train()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.1)
    ids, mask = _batch()["ids"], _batch()["mask"]

    def losses() -> torch.Tensor:
        logits = model(input_ids=ids, attention_mask=mask).logits
        return F.cross_entropy(logits, torch.tensor([0, 1, 1]), reduction="none")

    described = assert_like_loop(model, losses, rtol=1e-9, atol=1e-18)
    assert described["fallback"] == []


def test_ia3_records_like_the_loop_oracle() -> None:
    """IA3 scales activations by a vector built outside any layer (refused until its
    layer got a rule, gradlog/rules/adapters.py): attention and feed-forward forms."""
    model = peft.get_peft_model(_llama(), peft.IA3Config(
        task_type="CAUSAL_LM", target_modules=["k_proj", "v_proj", "down_proj"],
        feedforward_modules=["down_proj"])).train()
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn_like(p))
    described = assert_like_loop(model, _forward(model), rtol=1e-4, atol=1e-6)
    assert {m["rule"] for m in described["modules"]} == {"peft_ia3"}


class _ByHand(nn.Module):
    """An IA3-like scaling no rule knows: ``ParameterDict`` vectors used in the forward,
    one alone (``"one"``: a function of it, then a product with the data) or two combined
    first (``"two"``)."""

    def __init__(self, kind: str = "two") -> None:
        super().__init__()
        self.lin = nn.Linear(5, 3)
        self.vec = nn.ParameterDict({"a": nn.Parameter(torch.linspace(0.5, 1.5, 3)),
                                     "b": nn.Parameter(torch.ones(3))})
        self.kind = kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "one":
            return self.lin(x) * torch.exp(2 * self.vec["a"])  # type: ignore[no-any-return]
        return self.lin(x) * (self.vec["a"] * self.vec["b"])  # type: ignore[no-any-return]


def test_a_scaling_made_from_one_parameter_is_captured_op_by_op() -> None:
    """A function of one parameter alone (CLIP's ``logit_scale.exp()``) stays tracked as that
    parameter's use, so the product with the data that follows is its op: recorded like
    the loop (it was refused as an operation on parameters alone)."""
    from gradlog.testing.oracle import assert_like_loop

    model = _ByHand("one").to(D64)
    model.lin.requires_grad_(False)
    x = torch.randn(4, 5, dtype=D64)
    described = assert_like_loop(model, lambda: model(x).pow(2).sum(1), params="vec.a")
    assert described["ops"] == ["mul(vec.a): op:vjp"]


def test_an_unknown_adapter_scaling_is_refused_naming_the_fix(tmp_path: Path) -> None:
    model = _ByHand().to(D64)
    model.lin.requires_grad_(False)
    x = torch.randn(4, 5, dtype=D64)
    refused = pytest.raises(gradlog.errors.BackendError,
                            match=r"operation on parameters alone \(adapters build")
    with gradlog.GradRecorder(model, tmp_path / "r.gradlog", dtype="float64") as rec, refused:
        rec.backward(model(x).pow(2).sum(1))
