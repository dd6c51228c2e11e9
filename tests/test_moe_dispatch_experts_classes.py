"""Every experts class transformers registers either matches its eager forward through `experts_forward`
or is refused with a ValueError: never a silently different result (its own gate, another activation, a
post-expert norm, bias or another layout).

The classes are the ones transformers decorates with `use_experts_implementation`, found in its source;
each is built on a tiny config (its module's config class with small sizes) with random weights.
"""

import importlib
import inspect
import re
import typing
from pathlib import Path

import pytest
import torch
import transformers
from transformers.integrations.heterogeneity.configuration_utils import AmbiguousGlobalPerLayerAttributeError

# Small sizes under every name transformers' MoE configs use for them; lists (per-modality sizes) keep
# their length.
TINY_CONFIG = dict(
    hidden_size=32, moe_hidden_size=32, intermediate_size=16, moe_intermediate_size=16,
    expert_intermediate_size=16, expert_ffn_hidden_size=16, ffn_hidden_size=16, moe_ffn_hidden_size=16,
    num_experts=4, num_local_experts=4, n_routed_experts=4, moe_num_experts=4, num_experts_per_tok=2,
    moe_topk=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
)
# Plain SiLU experts: these must run on the kernel, not be refused.
MUST_MATCH = {"MixtralExperts", "Qwen3MoeExperts", "Qwen2MoeExperts", "DeepseekV3Experts", "OlmoeExperts",
              "Qwen3_5MoeExperts", "Lfm2MoeExperts"}
DECORATED = re.compile(r"^@use_experts_implementation\b.*\n(?:@.*\n)*class (\w+)\(", re.MULTILINE)


def _decorated_classes() -> list[tuple[str, str]]:
    models = Path(transformers.__file__).parent / "models"
    found = []
    for path in sorted(models.glob("*/modeling_*.py")):
        for name in DECORATED.findall(path.read_text()):
            found.append((f"transformers.models.{path.parent.name}.{path.stem}", name))
    return found


CLASSES = _decorated_classes()


def _init_args(cls) -> dict:
    """Sizes some experts classes take from their parent block instead of the config."""
    parameters = inspect.signature(cls.__init__.__wrapped__).parameters
    return {"intermediate_size": TINY_CONFIG["intermediate_size"]} if "intermediate_size" in parameters else {}


def _tiny_config(config_cls):
    config = config_cls()
    for key, value in TINY_CONFIG.items():
        try:
            old = getattr(config, key)
        except (AttributeError, AmbiguousGlobalPerLayerAttributeError):  # absent, or set per layer (Gemma4 head_dim)
            continue
        setattr(config, key, [value] * len(old) if isinstance(old, (list, tuple)) else value)
    config._experts_implementation = "eager"
    return config


def _build(module, cls) -> torch.nn.Module:
    """The experts module on a tiny config of the first config class of its module that builds it."""
    hints = typing.get_type_hints(cls.__init__.__wrapped__, globalns=vars(module))
    candidates = [hints["config"]] if inspect.isclass(hints.get("config")) else []
    configs = [c for c in vars(module).values()
               if inspect.isclass(c) and issubclass(c, transformers.PreTrainedConfig)]
    candidates += sorted(configs, key=lambda c: ("Text" not in c.__name__, c.__name__))
    errors = []
    for config_cls in candidates:
        try:
            config = _tiny_config(config_cls)
            with torch.device("meta"):
                cls(config, **_init_args(cls))
        except Exception as exc:
            errors.append(f"{config_cls.__name__}: {type(exc).__name__}: {exc}")
            continue
        experts = cls(config, **_init_args(cls)).float()
        with torch.no_grad():
            for p in experts.parameters():
                p.copy_(torch.randn_like(p) * 0.3)
        return experts
    raise AssertionError(f"no tiny config builds {cls.__name__}: {errors}")


def test_the_walk_finds_the_experts_classes():
    names = {name for _, name in CLASSES}
    assert len(CLASSES) >= 40 and MUST_MATCH <= names, sorted(names)


@pytest.mark.parametrize("module_name, class_name", CLASSES, ids=[name for _, name in CLASSES])
def test_experts_class_matches_eager_or_is_refused(load_kernel, monkeypatch, module_name, class_name):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the PyTorch path: semantics, not the kernel, are checked
    k = load_kernel("moe-dispatch")
    module = importlib.import_module(module_name)
    cls = getattr(module, class_name)
    torch.manual_seed(0)
    experts = _build(module, cls)
    num_experts = experts.gate_up_proj.shape[0] if hasattr(experts, "gate_up_proj") else experts.up_proj.shape[0]
    hidden = torch.randn(5, experts.down_proj.shape[1 if not getattr(experts, "is_transposed", False) else 2])
    ids = torch.stack([torch.randperm(num_experts)[:2] for _ in range(5)])
    weights = torch.rand(5, 2)
    with torch.no_grad():
        eager = experts(hidden, ids, weights)
        try:
            ours = k.experts_forward(experts, hidden, ids, weights)
        except ValueError as exc:
            assert class_name not in MUST_MATCH, f"{class_name} refused: {exc}"
            assert class_name in str(exc)
            return
    torch.testing.assert_close(ours, eager, rtol=1e-4, atol=1e-4)


def test_clamped_swiglu_is_refused(load_kernel):
    """The case that used to give a silently wrong result: GLM-5 Next's experts clamp their SwiGLU."""
    from transformers.models.glm5_next import modeling_glm5_next

    experts = _build(modeling_glm5_next, modeling_glm5_next.Glm5NextTextExperts)
    with pytest.raises(ValueError, match="own gate"):
        load_kernel("moe-dispatch").experts_forward(experts, torch.randn(3, 32), torch.zeros(3, 2, dtype=torch.long),
                                                    torch.rand(3, 2))
