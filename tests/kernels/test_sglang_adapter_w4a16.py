"""SGLang's compressed-tensors W4A16 linear and MoE schemes, patched to run tessera's INT4 kernels.

The layers are SGLang's own: its scheme classes create the parameters (``create_weights``), the
checkpoint tensors are written into them the way SGLang's loaders do (linear: as stored; MoE:
transposed per expert, gate then up), and the patched ``process_weights_after_loading`` /
``apply_weights`` of those classes run. Checkpoints are packed by the ``compressed_tensors``
library itself (``pack_to_int32``), and the reference is an fp32 matmul on weights dequantized
straight from the signed integers, so neither side borrows tessera's format code. Tolerance from
BENCHMARKS.md: rel-L2 <= 5e-3 against fp32 on the dequantized weights.

SGLang's own W4A16 compute cannot run here: both schemes repack for Marlin
(``gptq_marlin_repack``, ``gptq_marlin_moe_repack``) and multiply with Marlin's CUDA kernels from
``sgl_kernel``, which SGLang imports only when ``is_cuda()``; on a CPU there is no Marlin. The
comparison with SGLang's Marlin output is part of the GPU run.
"""

from __future__ import annotations

import pytest
import torch
from tessera.kernels.w4a16_moe import fused_moe_reference
from tessera.runtime.sglang_kernels import w4a16
from tessera.runtime.sglang_kernels.fallback import Fallbacks
from test_sglang_adapter_decode import seeded  # noqa: F401 (an autouse fixture)

# On a GPU SGLang imports ``sgl_kernel``, whose prebuilt ops library raises ImportError (not
# ModuleNotFoundError) where it does not match the installed torch: skip, saying so.
linear_mod = pytest.importorskip(
    "sglang.srt.layers.quantization.compressed_tensors.schemes.compressed_tensors_wNa16",
    exc_type=ImportError,
)
moe_mod = pytest.importorskip(
    "sglang.srt.layers.quantization.compressed_tensors.schemes.compressed_tensors_wNa16_moe",
    exc_type=ImportError,
)
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402
from sglang.srt.layers.moe import MoeRunnerConfig  # noqa: E402

pytestmark = pytest.mark.usefixtures("gpu_like_interpreter")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
REL_L2 = 5e-3


class Checkpoint:
    """One ``pack-quantized`` 4-bit weight ``[N, K]``: signed codes, scales, signed zero points."""

    def __init__(self, n: int, k: int, group: int, symmetric: bool) -> None:
        self.group = group
        self.q = torch.randint(-8, 8, (n, k), dtype=torch.int8)
        self.scale = (torch.rand(n, k // group) * 0.02 + 0.005).bfloat16()
        self.zero = None if symmetric else torch.randint(-8, 8, (n, k // group), dtype=torch.int8)

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"weight_packed": pack_to_int32(self.q, 4), "weight_scale": self.scale}
        if self.zero is not None:
            out["weight_zero_point"] = pack_to_int32(self.zero, 4, packed_dim=0)
        return out

    def dense(self) -> torch.Tensor:
        zero = 0 if self.zero is None else self.zero.float().repeat_interleave(self.group, 1)
        return (self.q.float() - zero) * self.scale.float().repeat_interleave(self.group, 1)


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm())


@pytest.fixture
def patched():
    w4a16.install()
    yield
    w4a16.uninstall()


def linear_layer(scheme, ckpt: Checkpoint, n: int, k: int, parts: list[int]):
    layer = torch.nn.Module()
    scheme.create_weights(layer, output_size=n, input_size=k, output_partition_sizes=parts,
                          input_size_per_partition=k, params_dtype=torch.bfloat16,
                          weight_loader=None)  # fmt: skip
    for name, t in ckpt.tensors().items():
        getattr(layer, name).data.copy_(t)
    layer.weight_shape.data.copy_(torch.tensor([n, k]))
    return layer.to(DEVICE)


@pytest.mark.parametrize(
    ("m", "parts", "k", "group", "symmetric", "bias"),
    [
        (1, [48], 128, 32, True, False),
        (5, [16, 24], 256, 64, False, True),  # a merged (e.g. gate/up) layer, asymmetric
        (3, [40], 384, 128, True, True),
    ],
)
def test_linear_scheme_runs_tessera_gemm(patched, m, parts, k, group, symmetric, bias):
    n = sum(parts)
    ckpt = Checkpoint(n, k, group, symmetric)
    scheme = linear_mod.CompressedTensorsWNA16(
        strategy="group", num_bits=4, group_size=group, symmetric=symmetric, actorder=None
    )
    layer = linear_layer(scheme, ckpt, n, k, parts)
    scheme.process_weights_after_loading(layer)
    # repacked once, at load: the checkpoint-format parameters are gone
    assert isinstance(getattr(layer, w4a16.WEIGHT_ATTR), w4a16.W4A16Weight)
    assert not hasattr(layer, "weight_packed") and not list(layer.parameters())
    x = torch.randn(m, k, device=DEVICE).bfloat16()
    b = torch.randn(n, device=DEVICE).bfloat16() if bias else None
    out = scheme.apply_weights(layer, x, b)
    ref = x.float() @ ckpt.dense().to(DEVICE).T + (0 if b is None else b.float())
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    assert rel_l2(out, ref) <= REL_L2


def moe_layer(scheme, gate, up, down, num_experts, hidden, inter, symmetric):
    """SGLang's MoE parameters, filled as its loader does for ``is_transposed`` weights."""
    layer = torch.nn.Module()
    layer.moe_tp_size = 1
    scheme.create_weights(
        layer, num_experts=num_experts, hidden_size=hidden,
        intermediate_size_per_partition=inter, params_dtype=torch.bfloat16,
    )  # fmt: skip
    for e in range(num_experts):
        g, u, d = gate[e].tensors(), up[e].tensors(), down[e].tensors()
        for name in ("weight_packed", "weight_scale") + (
            () if symmetric else ("weight_zero_point",)
        ):
            w13 = getattr(layer, f"w13_{name}").data[e]
            # the zero points' packed (output) dim is the columns' dim after the transpose
            cols = inter if name != "weight_zero_point" else inter // 8
            w13[:, :cols].copy_(g[name].T)
            w13[:, cols:].copy_(u[name].T)
            getattr(layer, f"w2_{name}").data[e].copy_(d[name].T)
    return layer.to(DEVICE)


@pytest.mark.parametrize(
    ("tokens", "num_experts", "top_k", "hidden", "inter", "group", "symmetric", "scaling"),
    [
        (3, 3, 2, 128, 128, 128, True, None),
        (5, 4, 3, 256, 128, 128, False, 2.5),
        (3, 3, 2, 128, 128, 32, True, None),  # group 32: the kernel's tightest case
    ],
)
def test_moe_scheme_runs_tessera_moe(
    patched, tokens, num_experts, top_k, hidden, inter, group, symmetric, scaling
):
    gate = [Checkpoint(inter, hidden, group, symmetric) for _ in range(num_experts)]
    up = [Checkpoint(inter, hidden, group, symmetric) for _ in range(num_experts)]
    down = [Checkpoint(hidden, inter, group, symmetric) for _ in range(num_experts)]
    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, group_size=group,
                            strategy="group")  # fmt: skip

    class Config:  # the one field of CompressedTensorsConfig the scheme reads
        quant_format = "pack-quantized"

    scheme = moe_mod.CompressedTensorsWNA16MoE(Config(), args)
    layer = moe_layer(scheme, gate, up, down, num_experts, hidden, inter, symmetric)
    scheme.moe_runner_config = MoeRunnerConfig(
        num_experts=num_experts, top_k=top_k, routed_scaling_factor=scaling
    )
    scheme.process_weights_after_loading(layer)
    assert not list(layer.parameters())
    w13, w2 = getattr(layer, w4a16.W13_ATTR), getattr(layer, w4a16.W2_ATTR)

    x = torch.randn(tokens, hidden, device=DEVICE).bfloat16()
    topk_ids = torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(tokens)]).int()
    topk_weights = torch.rand(tokens, top_k).softmax(-1)
    topk_ids, topk_weights = topk_ids.to(DEVICE), topk_weights.to(DEVICE)
    out = w4a16.moe_forward(w13, w2, x, topk_weights, topk_ids, scaling)

    dense13 = torch.stack(
        [torch.cat([g.dense(), u.dense()]).T for g, u in zip(gate, up, strict=True)]
    )
    dense2 = torch.stack([d.dense().T for d in down])
    ref = fused_moe_reference(x, dense13.to(DEVICE), dense2.to(DEVICE), topk_weights, topk_ids)
    ref = ref * (scaling or 1.0)
    assert out.shape == (tokens, hidden)
    assert rel_l2(out, ref) <= REL_L2


def test_unsupported_layers_keep_sglang_path_and_log_once():
    """Channel-wise and activation-order layers go to SGLang's own methods, untouched."""
    calls = []
    fallbacks = Fallbacks()
    process, apply = w4a16.make_linear_methods(
        lambda scheme, layer: calls.append(("process", layer)),
        lambda scheme, layer, x, bias: calls.append(("apply", layer)),
        fallbacks,
    )
    layers = []
    for strategy, group, actorder in (("channel", None, None), ("group", 128, "group")):
        scheme = linear_mod.CompressedTensorsWNA16(
            strategy=strategy, num_bits=4, group_size=group, symmetric=True, actorder=actorder
        )
        layer = torch.nn.Module()
        scheme.create_weights(layer, output_size=16, input_size=256, output_partition_sizes=[16],
                              input_size_per_partition=256, params_dtype=torch.bfloat16,
                              weight_loader=None)  # fmt: skip
        process(scheme, layer)
        apply(scheme, layer, None, None)
        process(scheme, layer)  # the same reason again is not logged again
        assert hasattr(layer, "weight_packed") and not hasattr(layer, w4a16.WEIGHT_ATTR)
        layers.append(layer)
    assert [c[0] for c in calls] == ["process", "apply", "process"] * 2
    assert sorted(fallbacks.counts.values()) == [2, 2]
    reasons = " ".join(r for _, r in fallbacks.counts)
    assert "channel-wise" in reasons and "activation-order" in reasons


@pytest.mark.gpu
@pytest.mark.parametrize(("m", "n", "k", "group"), [(1, 4096, 7168, 128), (16, 2048, 7168, 32)])
def test_gpu_linear_tessera_equals_sglang_marlin(m, n, k, group):
    """The same checkpoint through SGLang's own scheme (Marlin) and through the patched one."""
    cls = linear_mod.CompressedTensorsWNA16
    ckpt = Checkpoint(n, k, group, symmetric=True)
    scheme = cls(strategy="group", num_bits=4, group_size=group, symmetric=True, actorder=None)
    marlin, ours = linear_layer(scheme, ckpt, n, k, [n]), linear_layer(scheme, ckpt, n, k, [n])
    process, apply = w4a16.make_linear_methods(cls.process_weights_after_loading, cls.apply_weights)
    cls.process_weights_after_loading(scheme, marlin)
    process(scheme, ours)
    x = torch.randn(m, k, device=DEVICE).bfloat16()
    ref = x.float() @ ckpt.dense().to(DEVICE).T
    theirs, mine = cls.apply_weights(scheme, marlin, x, None), apply(scheme, ours, x, None)
    assert rel_l2(theirs, ref) <= REL_L2 and rel_l2(mine, ref) <= REL_L2
    assert rel_l2(mine, theirs.float()) <= REL_L2
