"""The experts rule (gradlog/rules/experts.py): transformers' mixture-of-experts modules in
closed form, against the loop oracle; the replay that keeps the fallback for a class whose
forward computes something else."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import nn

import gradlog
import gradlog.rules.experts as experts_rule
from gradlog.testing.oracle import assert_like_loop, backend_grads

transformers = pytest.importorskip("transformers")
moe = pytest.importorskip("transformers.integrations.moe")

D64 = torch.float64
Counter = Callable[[Any, str], list[int]]  # (conftest's calls_to)


def _experts_class(*, bias: bool, transposed: bool, gate: bool,
                   eager: str = "interface") -> type[nn.Module]:
    """An experts class of transformers' interface; its own (eager) forward loops over
    (row, choice) pairs: the interface's formula, or another function that the replay must
    catch: ``eager="other"`` (the routing weight inside the activation), and outputs 3% off
    only for experts from 2 on (``"high experts"``), for calls of more than 8 rows (``"many
    rows"``) or in 16 bits (``"in 16 bits"``)."""

    @moe.use_experts_implementation(is_transposed=transposed, has_bias=bias, has_gate=gate)
    class Experts(nn.Module):
        def __init__(self, config: Any) -> None:
            super().__init__()
            E, H, inner = config.experts, config.hidden, config.inner
            up = 2 * inner if gate else inner
            g = torch.Generator().manual_seed(config.seed)

            def shape(o: int, i: int) -> tuple[int, int, int]:
                return (E, i, o) if transposed else (E, o, i)

            self.num_experts = E
            name = "gate_up_proj" if gate else "up_proj"
            setattr(self, name, nn.Parameter(torch.randn(shape(up, H), generator=g, dtype=D64)))
            self.down_proj = nn.Parameter(torch.randn(shape(H, inner), generator=g, dtype=D64))
            if bias:
                setattr(self, f"{name}_bias",
                        nn.Parameter(torch.randn(E, up, generator=g, dtype=D64)))
                self.down_proj_bias = nn.Parameter(torch.randn(E, H, generator=g, dtype=D64))
            self.act_fn = nn.SiLU()

        def forward(self, x: torch.Tensor, index: torch.Tensor,
                    weights: torch.Tensor) -> torch.Tensor:
            up = self.gate_up_proj if gate else self.up_proj
            out = torch.zeros_like(x)
            for n in range(x.shape[0]):
                for k in range(index.shape[1]):
                    e = int(index[n, k])
                    u = x[n] @ up[e] if transposed else up[e] @ x[n]
                    if bias:
                        u = u + (self.gate_up_proj_bias if gate else self.up_proj_bias)[e]
                    if eager == "other":
                        u = u * weights[n, k]
                    z = self._apply_gate(u) if gate else self.act_fn(u)
                    y = z @ self.down_proj[e] if transposed else self.down_proj[e] @ z
                    if bias:
                        y = y + self.down_proj_bias[e]
                    if (eager == "high experts" and e >= 2) or (
                            eager == "many rows" and x.shape[0] > 8) or (
                            eager == "in 16 bits" and torch.finfo(x.dtype).bits <= 16):
                        y = 1.03 * y
                    out[n] = out[n] + (y if eager == "other" else weights[n, k] * y)
            return out

    return Experts


class _Mixture(nn.Module):
    """A router (a Linear) and the experts on the batch's tokens flattened to rows, as
    transformers' sparse blocks call them."""

    def __init__(self, experts: nn.Module, hidden: int, n_experts: int, k: int) -> None:
        super().__init__()
        self.router = nn.Linear(hidden, n_experts).double()
        self.experts = experts
        self.k = k

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # (B, T, H)
        rows = h.reshape(-1, h.shape[-1])  # (B*T, H)
        weights, index = torch.softmax(self.router(rows), -1).topk(self.k, -1)
        return self.experts(rows, index, weights).view(h.shape)


def _mixture(impl: str, *, E: int = 4, K: int = 2, H: int = 5, inner: int = 3,
             seed: int = 0, **options: Any) -> _Mixture:
    config = types.SimpleNamespace(_experts_implementation=impl, experts=E, hidden=H,
                                   inner=inner, seed=seed)
    torch.manual_seed(seed)
    return _Mixture(_experts_class(**options)(config), H, E, K)


def _losses(model: nn.Module, B: int, T: int, seed: int = 1) -> Callable[[], torch.Tensor]:
    h = torch.randn(B, T, model.router.in_features, dtype=D64,
                    generator=torch.Generator().manual_seed(seed))
    return lambda: ((model(h) + h) ** 2).flatten(1).sum(1)  # (B,)


@given(B=st.integers(1, 4), T=st.integers(1, 5), E=st.integers(1, 5), K=st.integers(1, 3),
       bias=st.booleans(), transposed=st.booleans(), gate=st.booleans(),
       impl=st.sampled_from(["batched_mm", "eager"]), seed=st.integers(0, 2**16))
@settings(max_examples=25, deadline=None)
def test_experts_rule_equals_the_loop_oracle(B: int, T: int, E: int, K: int, bias: bool,
                                             transposed: bool, gate: bool, impl: str,
                                             seed: int) -> None:
    """Every layout of the interface (gated or not, transposed, biases), routing that leaves
    experts unused or sends a datum's every token to one, against the loop backend. (T == B
    is refused for rows flattened from (B, T, d): they could be time-major.)"""
    assume(T != B)
    K = min(K, E)
    model = _mixture(impl, E=E, K=K, seed=seed, bias=bias, transposed=transposed, gate=gate)
    described = assert_like_loop(model, _losses(model, B, T, seed), reductions=("mean",))
    rules = {m["module"]: m["rule"] for m in described["modules"]}
    assert rules["experts"] == "experts"


@pytest.mark.parametrize("impl", ["eager", "batched_mm"])
def test_the_rule_uses_its_formula_and_not_the_re_run(impl: str,
                                                      calls_to: Counter) -> None:
    calls = calls_to(experts_rule, "generic")
    model = _mixture(impl, bias=True, transposed=False, gate=True)
    assert_like_loop(model, _losses(model, 3, 4), reductions=("mean", "sum"))
    assert not calls


def test_a_forward_other_than_the_interface_keeps_the_re_run(
        calls_to: Counter) -> None:
    """A class's own forward that weights the routing inside the activation: the formula
    would be wrong; the replay sees the outputs differ and the module is re-run per datum,
    equal to the loop oracle. The interface's implementation of the same module uses the
    formula."""
    calls = calls_to(experts_rule, "generic")
    model = _mixture("eager", bias=False, transposed=False, gate=True, eager="other")
    assert_like_loop(model, _losses(model, 3, 4), reductions=("mean",))
    assert calls
    calls.clear()
    model.experts.config._experts_implementation = "batched_mm"
    assert_like_loop(model, _losses(model, 3, 4), reductions=("mean",))
    assert not calls


@pytest.mark.parametrize("eager", ["interface", "other", "high experts", "many rows",
                                   "in 16 bits"])
def test_bf16_experts_are_replayed_in_float32(eager: str, calls_to: Counter) -> None:
    """bf16 experts: in 16 bits a correct forward rounds as much as a wrong formula, so the
    replay runs a float32 copy of the module on the call (every expert, every row), and the
    module as it is in aggregate. The interface's forward uses the formula (within bf16
    rounding of the loop's records); a forward that computes something else, even 3% off
    for some experts, some calls or only in 16 bits (a campaign's hunts: a copy of a few
    experts on a few rows let the first two through), is caught and re-run per datum."""
    calls = calls_to(experts_rule, "generic")
    model = _mixture("eager", E=5, K=2, H=8, inner=6, bias=True, transposed=False, gate=True,
                     eager=eager).bfloat16()
    h = torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(1)).bfloat16()

    def losses() -> torch.Tensor:
        return ((model(h) + h) ** 2).flatten(1).float().sum(1)

    want, _, _ = backend_grads(model, losses, "loop", "sum", params="experts.*")
    assert not calls
    got, _, _ = backend_grads(model, losses, "hooks", "sum", params="experts.*")
    assert bool(calls) == (eager != "interface")
    if eager == "many rows":
        return  # (a function of the batch's size: the re-run on one datum's rows differs too)
    for name, loop in want.items():
        err = (got[name].double() - loop.double()).norm() / loop.double().norm()
        assert err < 0.02, (name, float(err))


def test_a_post_expert_norm_or_expert_parallelism_is_not_taken() -> None:
    """What the formula does not compute gets no rule (the per-datum re-run)."""
    from gradlog.rules import find_rule

    model = _mixture("eager", bias=False, transposed=False, gate=True)
    assert find_rule(model.experts).name == "experts"
    model.experts._is_expert_parallel = True
    assert find_rule(model.experts) is None
    model.experts._is_expert_parallel = False
    model.experts.has_post_expert_norm = True
    assert find_rule(model.experts) is None


def test_mixtral_recorded_end_to_end_with_every_check(tmp_path: Any) -> None:
    """transformers' Mixtral through GradRecorder (datum and spot checks on every step, the
    `full` form): the stored records equal the loop oracle's."""
    cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                     num_hidden_layers=2, num_attention_heads=2,
                                     num_key_value_heads=1, max_position_embeddings=32,
                                     num_local_experts=4, num_experts_per_tok=2)
    cfg._experts_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(cfg).double().train()
    ids = torch.randint(1, 64, (3, 6), generator=torch.Generator().manual_seed(2))

    def losses() -> torch.Tensor:
        logits = model(input_ids=ids).logits[:, :-1]
        return nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:],
                                           reduction="none").mean(1)

    want, _, _ = backend_grads(model, losses, "loop", params="*experts*")
    path = tmp_path / "run.gradlog"
    with gradlog.GradRecorder(model, path, params="*experts*", check_every=1) as rec:
        rec.backward(losses())
    run = gradlog.open(path)
    for name, grads in want.items():
        stored = torch.as_tensor(run.grads(name, step=0))  # (float32, the store's default)
        torch.testing.assert_close(stored, grads.float(), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
def test_mixtral_under_bf16_autocast_passes_every_check(impl: str, tmp_path: Any) -> None:
    """Under autocast the experts' matmuls and the router's logits run in bf16 while their
    outputs are float32. The self-check refused both (checked at float32's tolerance, and
    the router re-run per datum in float32 picked other experts on near-ties): now the
    experts' p.grad counts as rounded in bf16, and a module re-run per datum runs under the
    autocast its forward ran under."""
    cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=2, num_attention_heads=2,
                                     num_key_value_heads=1, max_position_embeddings=32,
                                     num_local_experts=4, num_experts_per_tok=2)
    cfg._experts_implementation = impl
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(cfg).train()
    ids = torch.randint(1, 64, (4, 12), generator=torch.Generator().manual_seed(2))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with gradlog.GradRecorder(model, tmp_path / "run.gradlog", check_every=1) as rec:
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(input_ids=ids).logits[:, :-1]
            rec.backward(nn.functional.cross_entropy(
                logits.float().transpose(1, 2), ids[:, 1:], reduction="none").mean(1))
            opt.step()
            opt.zero_grad()
    assert len(gradlog.open(tmp_path / "run.gradlog").steps) == 3


@pytest.mark.skipif(not hasattr(transformers, "DeepseekV3Config"), reason="no DeepSeek-V3")
def test_deepseek_v3_records_like_the_loop_oracle() -> None:
    """DeepSeek-V3: its router takes (B, T, d) and flattens it itself (re-run per datum,
    the inputs split as a batch, the outputs as rows: it was refused), group-limited top-k
    routing, shared experts, the experts by the rule; padded batch, float64."""
    cfg = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=1, q_lora_rank=8, kv_lora_rank=8, qk_rope_head_dim=4,
        qk_nope_head_dim=4, v_head_dim=4, max_position_embeddings=32)
    cfg._experts_implementation = "eager"
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(cfg).double().train()
    with torch.no_grad():
        model.model.layers[1].mlp.gate.weight.normal_(0, 0.5)  # (zeros at init)
    ids = torch.randint(1, 64, (3, 7), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[0, 5:] = 0
    keep = mask[:, 1:].double()

    def losses() -> torch.Tensor:
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
        per_token = nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:],
                                                reduction="none")
        return (per_token * keep).sum(1) / keep.sum(1)

    described = assert_like_loop(model, losses, reductions=("mean",), rtol=1e-4, atol=1e-6)
    rules = {m["module"]: m["rule"] for m in described["modules"]}
    assert rules["model.layers.1.mlp.experts"] == "experts"
