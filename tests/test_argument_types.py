"""Every public function of the three kernels answers a wrong argument with a TypeError or ValueError that
names the argument, raised before the op dispatcher sees it (whose own error is a generic RuntimeError)."""

import pytest
import torch


def _x():
    return torch.randn(4, 64)


def _half():
    return torch.randn(2, 256, dtype=torch.float16)


def _experts_args():
    return (torch.randn(5, 32), torch.randn(4, 32, 32), torch.randn(4, 32, 16), torch.rand(5, 2),
            torch.zeros(5, 2, dtype=torch.int32))


CASES = {
    "rms_norm x list": ("rmsnorm", lambda k: k.rms_norm([[1.0] * 64], torch.rand(64)), TypeError, "x must be"),
    "rms_norm weight list": ("rmsnorm", lambda k: k.rms_norm(_x(), [1.0] * 64), TypeError, "weight must be"),
    "rms_norm eps str": ("rmsnorm", lambda k: k.rms_norm(_x(), None, eps="x"), TypeError, "eps must be"),
    "rms_norm eps None": ("rmsnorm", lambda k: k.rms_norm(_x(), None, eps=None), TypeError, "eps must be"),
    "rms_norm offset str": ("rmsnorm", lambda k: k.rms_norm(_x(), torch.rand(64), offset="1"), TypeError,
                            "offset must be"),
    "fused residual list": ("rmsnorm", lambda k: k.fused_add_rms_norm(_x(), [1.0], None), TypeError,
                            "residual must be"),
    "fused residual None": ("rmsnorm", lambda k: k.fused_add_rms_norm(_x(), None, None), TypeError,
                            "residual must be"),
    "fused inplace str": ("rmsnorm", lambda k: k.fused_add_rms_norm(_x(), _x(), None, inplace="yes"), TypeError,
                          "inplace must be"),
    "fused inplace eps str": ("rmsnorm", lambda k: k.fused_add_rms_norm(_x(), _x(), None, eps="x", inplace=True),
                              TypeError, "eps must be"),
    "matmul x list": ("w4a16", lambda k: k.matmul([[1.0]], k.quantize(torch.randn(96, 256))), TypeError,
                      "x must be"),
    "matmul qweight tensor": ("w4a16", lambda k: k.matmul(_half(), torch.randn(96, 256)), TypeError,
                              "qweight must be"),
    "matmul bias list": ("w4a16", lambda k: k.matmul(_half(), k.quantize(torch.randn(96, 256)), [0.0] * 96),
                         TypeError, "bias must be"),
    "dequantize dtype str": ("w4a16", lambda k: k.dequantize(k.quantize(torch.randn(96, 256)), "x"), TypeError,
                             "dtype must be"),
    "quantize weight list": ("w4a16", lambda k: k.quantize([[1.0] * 256]), TypeError, "weight must be"),
    "quantize group_size str": ("w4a16", lambda k: k.quantize(torch.randn(96, 256), group_size="a"), TypeError,
                                "group_size must be"),
    "quantize_model str": ("w4a16", lambda k: k.quantize_model("model"), TypeError, "model must be"),
    "save_quantized int": ("w4a16", lambda k: k.save_quantized(3, "unused.safetensors"), TypeError,
                           "weights must be"),
    "from_gptq list": ("w4a16", lambda k: k.from_gptq([1], [1], [1]), TypeError, "qweight must be"),
    "route logits list": ("moe-dispatch", lambda k: k.route([[1.0]], 1), TypeError, "router_logits must be"),
    "route top_k str": ("moe-dispatch", lambda k: k.route(torch.randn(3, 4), "2"), TypeError, "top_k must be"),
    "route scoring int": ("moe-dispatch", lambda k: k.route(torch.randn(3, 4), 2, scoring=3), TypeError,
                          "scoring must be"),
    "route scaling str": ("moe-dispatch", lambda k: k.route(torch.randn(3, 4), 2, scaling_factor="2"), TypeError,
                          "scaling_factor must be"),
    "fused_experts activation int": ("moe-dispatch", lambda k: k.fused_experts(*_experts_args(), activation=3),
                                     TypeError, "activation must be"),
    "fused_experts w_down wrong I": (
        "moe-dispatch",
        lambda k: k.fused_experts(*_experts_args()[:2], torch.randn(4, 32, 8), *_experts_args()[3:]),
        ValueError, "w_down must be"),
    "fused_experts w_down wrong E": (
        "moe-dispatch",
        lambda k: k.fused_experts(*_experts_args()[:2], torch.randn(3, 32, 16), *_experts_args()[3:]),
        ValueError, "w_down must be"),
    "fused_experts w_gate_up wrong H": (
        "moe-dispatch",
        lambda k: k.fused_experts(_experts_args()[0], torch.randn(4, 32, 16), *_experts_args()[2:]),
        ValueError, "w_gate_up must be"),
    "moe_forward renormalize str": (
        "moe-dispatch",
        lambda k: k.moe_forward(torch.randn(5, 32), torch.randn(4, 32), torch.randn(4, 32, 32),
                                torch.randn(4, 32, 16), 2, renormalize="yes"),
        TypeError, "renormalize must be"),
    "experts_forward hidden list": ("moe-dispatch", lambda k: k.experts_forward(
        torch.nn.Module(), [1.0], torch.zeros(1, 1), torch.zeros(1, 1)), TypeError, "hidden_states must be"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_argument_is_named(load_kernel, case):
    kernel, call, error, message = CASES[case]
    with pytest.raises(error, match=message):
        call(load_kernel(kernel))
