"""The SGLang kernel adapter's decisions: per-family plan for every CRD dtype combination, the
contract check against the installed SGLang (and against deliberately wrong contracts), the
plugin entry point, and which decode calls fall back to SGLang's kernel."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tessera.runtime.config import (
    KernelsConfig,
    KVCacheConfig,
    ModelConfig,
    ParallelConfig,
    RuntimeConfig,
    WeightsConfig,
)
from tessera.runtime.sglang_kernels import (
    PINNED,
    Contract,
    ContractError,
    contract_problems,
    kernel_problem,
    plan_kernels,
    verify,
)
from tessera.runtime.sglang_kernels.contract import DECODE_ATTENTION_FWD, Target, signature_problem
from tessera.runtime.sglang_kernels.decode_attention import longest_bound
from tessera.runtime.sglang_kernels.plugin import apply, load

pytest.importorskip("sglang")


def config(kv="fp8_e4m3", weights=("int4", "compressed-tensors"), attention="tessera",
           w4a16="tessera") -> RuntimeConfig:  # fmt: skip
    return RuntimeConfig(
        deployment="kimi-k2",
        namespace="llm",
        phase="decode",
        model=ModelConfig(name="kimi", path="/models/kimi"),
        weights=WeightsConfig(dtype=weights[0], format=weights[1]),
        kv_cache=KVCacheConfig(dtype=kv),
        kernels=KernelsConfig(decode_attention=attention, w4a16=w4a16),
    )


WEIGHTS = [
    ("bf16", "safetensors"),
    ("fp8", "safetensors"),
    ("fp8", "compressed-tensors"),
    ("int4", "compressed-tensors"),
    ("int4", "awq"),
    ("int4", "gptq"),
]


@pytest.mark.parametrize("kv", ["bf16", "fp8_e4m3"])
def test_flashmla_decode_attention_patches_nothing(kv):
    plan = plan_kernels(config(kv, attention="flashmla", w4a16="sglang"))
    assert plan.patched == frozenset()
    assert "decode_attention: sglang (SGLang's FlashMLA backend" in plan.lines()[0]


@pytest.mark.parametrize("kv", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("switches", [("tessera", "tessera"), ("sglang", "sglang")])
def test_plan_covers_every_crd_combination(kv, weights, switches):
    plan = plan_kernels(config(kv, weights, *switches))
    by_family = {f.family: f for f in plan.families}
    if switches == ("sglang", "sglang"):
        assert plan.patched == frozenset()
        assert all("switch set to sglang" in f.reason for f in plan.families)
        return
    # both KV dtypes have a tessera decode kernel
    assert by_family["decode_attention"].patch
    assert kv in by_family["decode_attention"].reason
    w4 = by_family["w4a16"]
    if weights == ("int4", "compressed-tensors"):
        assert w4.patch
    else:
        # no tessera kernel for these weights: the switch is a no-op, and says so
        assert not w4.patch and w4.reason.startswith("no-op")
        assert weights[0] in w4.reason or weights[1] in w4.reason
    assert len(plan.lines()) == 2


@pytest.mark.parametrize("expert, says", [
    (1, "linear and MoE layers run tessera's INT4 kernels"),
    (8, "MoE layers stay on SGLang's Marlin (expert parallelism 8)"),
])
def test_w4a16_says_which_layers_it_serves(expert, says):
    cfg = config().model_copy(update={"parallel": ParallelConfig(tensor=8, expert=expert)})
    w4 = {f.family: f for f in plan_kernels(cfg).families}["w4a16"]
    assert w4.patch and says in w4.reason


def test_pinned_contract_matches_the_installed_sglang():
    assert contract_problems(PINNED, "0.5.23") == []
    verify()  # the installed distribution's own version


def wrong_decode_contract() -> Contract:
    params = tuple(p for p in DECODE_ATTENTION_FWD.params if p != "uneven_batch") + ("page_table",)
    return Contract("0.5.23", (dataclasses.replace(DECODE_ATTENTION_FWD, params=params),))


def test_a_signature_mismatch_fails_with_a_clear_message():
    with pytest.raises(ContractError) as err:
        verify(wrong_decode_contract())
    message = str(err.value)
    assert "decode_attention.decode_attention_fwd" in message
    assert "lost page_table" in message and "gained uneven_batch" in message
    assert "cannot start" in message and "'sglang'" in message


def test_a_version_mismatch_fails_with_a_clear_message():
    with pytest.raises(ContractError, match=r"SGLang 0\.5\.23 is installed, .* pinned to 0\.6\.0"):
        verify(Contract("0.6.0", PINNED.targets))
    assert contract_problems(PINNED, None) == ["SGLang is not installed"]


@pytest.mark.parametrize(
    ("actual", "expected"),
    [
        (None, "is missing"),
        (("a", "c", "b"), "reordered"),
        (("a", "b"), "lost c"),
        (("a", "b", "c", "d"), "gained d"),
        (("a", "b", "c"), None),
    ],
)
def test_signature_problem(actual, expected):
    problem = signature_problem(Target("x", "m", "f", ("a", "b", "c")), actual)
    assert problem is None if expected is None else expected in problem


def test_missing_module_or_attribute_is_reported():
    contract = Contract(
        "0.5.23",
        (
            Target("x", "sglang.no_such_module", "f", ()),
            Target("x", DECODE_ATTENTION_FWD.module, "no_such_function", ()),
        ),
    )
    problems = contract_problems(contract, "0.5.23")
    assert len(problems) == 2 and all("is missing" in p for p in problems)


def test_a_lost_seam_fails_with_a_clear_message():
    from tessera.runtime.sglang_kernels.contract import TRITON_BACKEND_SEAM

    lines = (*TRITON_BACKEND_SEAM.lines[:2], "self.decode_attention_fwd = decode_attention_fwd")
    contract = Contract("0.5.23", (), (dataclasses.replace(TRITON_BACKEND_SEAM, lines=lines),))
    with pytest.raises(ContractError, match=r"triton_backend no longer has: self\.decode_att"):
        verify(contract)
    missing = Contract("0.5.23", (), (dataclasses.replace(TRITON_BACKEND_SEAM, module="sglang.x"),))
    assert contract_problems(missing, "0.5.23") == ["sglang.x is missing"]


def test_only_the_planned_families_are_checked():
    wrong = wrong_decode_contract()
    # the broken target belongs to decode attention: with that family off, nothing to check
    assert kernel_problem(config(attention="sglang"), wrong) is None
    assert "decode_attention_fwd" in kernel_problem(config(), wrong)
    assert kernel_problem(config()) is None


def test_apply_checks_before_patching_anything():
    from sglang.kernels.ops.attention import decode_attention as module

    before = module.decode_attention_fwd
    with pytest.raises(ContractError):
        apply(config(w4a16="sglang"), wrong_decode_contract())
    assert module.decode_attention_fwd is before


def test_plugin_stops_the_process_on_a_mismatch(tmp_path, monkeypatch):
    path = tmp_path / "runtime.json"
    path.write_text(config(w4a16="sglang").to_json())
    monkeypatch.setenv("TESSERA_RUNTIME_CONFIG", str(path))
    with pytest.raises(SystemExit, match="decode_attention_fwd"):
        load(wrong_decode_contract())


def test_plugin_without_a_config_installs_nothing(monkeypatch):
    from sglang.kernels.ops.attention import decode_attention as module

    monkeypatch.delenv("TESSERA_RUNTIME_CONFIG", raising=False)
    before = module.decode_attention_fwd
    load()
    assert module.decode_attention_fwd is before


def test_plugin_installs_the_planned_families(tmp_path, monkeypatch):
    from sglang.kernels.ops.attention import decode_attention as module
    from tessera.runtime.sglang_kernels import decode_attention, w4a16

    path = tmp_path / "runtime.json"
    path.write_text(config(weights=("fp8", "safetensors")).to_json())
    monkeypatch.setenv("TESSERA_RUNTIME_CONFIG", str(path))
    before = module.decode_attention_fwd
    linear, _ = w4a16._classes()
    try:
        load()
        assert module.decode_attention_fwd is not before
        assert not hasattr(linear.apply_weights, w4a16.ORIGINAL_ATTR)  # fp8 weights: no-op
    finally:
        decode_attention.uninstall()
    assert module.decode_attention_fwd is before


def decode_args(q_dim=64, kv_dtype=torch.bfloat16, heads=4, kv_heads=2, v_dim=None, out=None):
    q = torch.zeros(2, heads, q_dim, dtype=torch.bfloat16)
    k = torch.zeros(10, kv_heads, q_dim).to(kv_dtype)
    v = torch.zeros(10, kv_heads, v_dim or q_dim).to(kv_dtype)
    o = torch.zeros(2, heads, v_dim or q_dim, dtype=out or torch.bfloat16)
    return q, k, v, o


FLAGS = dict(k_scale=1.0, v_scale=1.0, logit_cap=0.0, sinks=None, xai_temperature_len=-1,
             score_mod=None)  # fmt: skip


@pytest.mark.parametrize(
    ("args", "flags", "reason"),
    [
        (decode_args(), {}, None),
        (decode_args(kv_dtype=torch.float8_e4m3fn), {"k_scale": 0.5, "v_scale": 0.1}, None),
        (decode_args(), {"logit_cap": 30.0}, "logit soft-capping"),
        (decode_args(), {"sinks": torch.zeros(4)}, "sinks"),
        (decode_args(), {"xai_temperature_len": 8}, "xAI"),
        (decode_args(), {"score_mod": object()}, "score_mod"),
        (decode_args(out=torch.float32), {}, "context-parallel"),
        (decode_args(q_dim=96), {}, "qk head dim 96"),
        (decode_args(v_dim=48), {}, "v head dim 48"),
        (decode_args(kv_dtype=torch.float16), {}, "float16 KV"),
        (decode_args(heads=6, kv_heads=4), {}, "6 query heads over 4"),
        (decode_args(), {"v_scale": 2.0}, "v_scale other than 1"),
        (decode_args(), {"page_size": 64}, None),
        (decode_args(), {"page_size": 48}, "page size 48"),
    ],
)
def test_decode_fallback_decisions(args, flags, reason):
    from tessera.runtime.sglang_kernels.decode_attention import unsupported

    got = unsupported(*args, **{**FLAGS, **flags})
    assert got is None if reason is None else reason in got


def test_mla_form_is_the_latent_prefix_of_the_same_rows():
    from tessera.runtime.sglang_kernels.decode_attention import is_mla_form, unsupported

    kv = torch.zeros(10, 1, 576, dtype=torch.bfloat16)
    q = torch.zeros(2, 16, 576, dtype=torch.bfloat16)
    o = torch.zeros(2, 16, 512, dtype=torch.bfloat16)
    assert is_mla_form(kv, kv[..., :512])
    assert not is_mla_form(kv, kv[..., :512].clone())  # a copy is not SGLang's MLA pool
    assert unsupported(q, kv, kv[..., :512], o, **FLAGS) is None
    assert "MLA head dims" in unsupported(q[..., :256], kv[..., :256], kv[..., :192], o[..., :192],
                                          **FLAGS)  # fmt: skip


def load_with_a_wrong_contract() -> None:
    """An entry point like the real one, checked against a deliberately wrong contract."""
    load(wrong_decode_contract())


def register_plugin(tmp_path, monkeypatch, target: str) -> None:
    """Make an installed distribution that declares ``target`` in SGLang's plugin group."""
    dist = tmp_path / "tessera_plugin_probe-0.0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: tessera-plugin-probe\n"
                                   "Version: 0.0.0\n")  # fmt: skip
    (dist / "entry_points.txt").write_text(f"[sglang.srt.plugins]\ntessera_kernels = {target}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("SGLANG_PLUGINS", "tessera_kernels")


def test_sglangs_own_plugin_loader_runs_the_entry_point_and_stops_on_a_mismatch(
    tmp_path, monkeypatch
):
    """SGLang's ``load_plugins`` swallows plugin exceptions; a contract mismatch still stops it."""
    import sglang.srt.plugins as plugins

    path = tmp_path / "runtime.json"
    path.write_text(config(w4a16="sglang").to_json())
    monkeypatch.setenv("TESSERA_RUNTIME_CONFIG", str(path))
    register_plugin(tmp_path, monkeypatch, f"{__name__}:load_with_a_wrong_contract")
    found = plugins.load_plugins_by_group(plugins.GENERAL_PLUGINS_GROUP)
    assert set(found) == {"tessera_kernels"}
    monkeypatch.setattr(plugins, "_plugins_loaded", False)
    with pytest.raises(SystemExit, match="decode_attention_fwd"):
        plugins.load_plugins()


def test_sglangs_own_plugin_loader_installs_the_planned_patch(tmp_path, monkeypatch):
    import sglang.srt.plugins as plugins
    from sglang.kernels.ops.attention import decode_attention as module
    from tessera.runtime.sglang_kernels import decode_attention

    path = tmp_path / "runtime.json"
    path.write_text(config(w4a16="sglang").to_json())
    monkeypatch.setenv("TESSERA_RUNTIME_CONFIG", str(path))
    register_plugin(tmp_path, monkeypatch, "tessera.runtime.sglang_kernels.plugin:load")
    monkeypatch.setattr(plugins, "_plugins_loaded", False)
    before = module.decode_attention_fwd
    try:
        plugins.load_plugins()
        assert hasattr(module.decode_attention_fwd, decode_attention.ORIGINAL_ATTR)
    finally:
        decode_attention.uninstall()
    assert module.decode_attention_fwd is before


def moe_scheme_and_layer(num_bits=4, group=128, actorder=None, ep=1, **runner):
    from compressed_tensors.quantization import QuantizationArgs
    from sglang.srt.layers.moe import MoeRunnerConfig
    from sglang.srt.layers.quantization.compressed_tensors.schemes import (
        compressed_tensors_wNa16_moe as moe_mod,
    )

    class Config:  # the one field of CompressedTensorsConfig the scheme reads
        quant_format = "pack-quantized"

    args = QuantizationArgs(num_bits=num_bits, type="int", symmetric=True, group_size=group,
                            strategy="group", actorder=actorder)  # fmt: skip
    scheme = moe_mod.CompressedTensorsWNA16MoE(Config(), args)
    layer = torch.nn.Module()
    layer.moe_tp_size, layer.moe_ep_size = 1, ep
    scheme.create_weights(
        layer, num_experts=2, hidden_size=256, intermediate_size_per_partition=128,
        params_dtype=torch.bfloat16,
    )  # fmt: skip
    scheme.moe_runner_config = MoeRunnerConfig(num_experts=2, top_k=1, **runner)
    return scheme, layer


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({}, None),
        ({"group": 32}, None),
        ({"num_bits": 8}, "8-bit weights"),
        ({"group": 256}, "group size 256"),
        ({"actorder": "weight"}, "activation order"),
        ({"ep": 8}, "expert parallelism"),
        ({"activation": "gelu"}, "activation gelu"),
        ({"swiglu_limit": 7.0}, "swiglu_limit"),
        ({"apply_router_weight_on_input": True}, "router weights on the input"),
    ],
)
def test_moe_layer_decisions(kwargs, reason):
    from tessera.runtime.sglang_kernels.w4a16 import moe_unsupported

    got = moe_unsupported(*moe_scheme_and_layer(**kwargs))
    assert got is None if reason is None else reason in got


def test_longest_bound_reads_the_context_from_sglangs_graph_buffers() -> None:
    rows, context = 256, 131072  # SGLang's graph buffers: rows x context slots, rows of logits
    assert longest_bound(rows * context, rows, 64, capturing=True) == context
    assert longest_bound(rows * context, rows, 64, capturing=False) == context  # its warm-up
    assert longest_bound(rows * context, rows, rows, capturing=True) == context  # largest graph
    # eagerly the table holds the batch's own slots: their count bounds every request
    assert longest_bound(3 * 4096 + 17, 4, 4, capturing=False) == 3 * 4096 + 17
    assert longest_bound(0, 0, 0, capturing=False) == 1
