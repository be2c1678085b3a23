"""Model configuration parsed from an HF `config.json` dict (Llama 2/3/3.1/3.2, Qwen2/2.5, Qwen3).

Everything the forward pass needs is validated here, so an unsupported checkpoint fails at load time with a message
that names the field, never later as a wrong answer.
"""

from __future__ import annotations

import dataclasses
import math

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # "default" | "llama3" | "linear"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab: int
    hidden: int
    ffn: int
    num_layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    rms_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    max_position_embeddings: int = 8192
    tie_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""

    def __post_init__(self):
        for f in ("vocab", "hidden", "ffn", "num_layers", "q_heads", "kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, f) <= 0:
                raise ValueError(f"model config: {f} must be positive, got {getattr(self, f)}")
        if self.q_heads % self.kv_heads:
            raise ValueError(f"model config: num_attention_heads ({self.q_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"model config: head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def group(self) -> int:
        return self.q_heads // self.kv_heads

    @classmethod
    def from_hf(cls, cfg: dict, name: str = "") -> "ModelConfig":
        mt = cfg.get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {mt!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r}: only 'silu' (SwiGLU) is implemented")
        if cfg.get("mlp_bias", False):
            raise ValueError("unsupported config field mlp_bias=True")
        if cfg.get("use_sliding_window", False):
            raise ValueError("unsupported config field use_sliding_window=True (sliding-window attention)")
        if cfg.get("pretraining_tp", 1) not in (1, None) and mt != "llama":
            raise ValueError(f"unsupported pretraining_tp={cfg.get('pretraining_tp')}")
        q_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = int(cfg.get("head_dim") or hidden // q_heads)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else []))
        if mt == "qwen2":
            qkv_bias = True
        else:
            qkv_bias = bool(cfg.get("attention_bias", False))
        return cls(
            model_type=mt,
            vocab=int(cfg["vocab_size"]),
            hidden=hidden,
            ffn=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            q_heads=q_heads,
            kv_heads=int(cfg.get("num_key_value_heads") or q_heads),
            head_dim=head_dim,
            rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=_rope_from_hf(cfg),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", mt != "llama")),
            qkv_bias=qkv_bias,
            qk_norm=(mt == "qwen3"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=name or cfg.get("_name_or_path", ""),
        )


def _rope_from_hf(cfg: dict) -> RopeConfig:
    params = dict(cfg.get("rope_parameters") or {})  # transformers v5 layout
    scaling = cfg.get("rope_scaling") or {}
    params.update({k: v for k, v in scaling.items() if v is not None})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return RopeConfig(theta=theta)
    factor = float(params.get("factor", 1.0))
    if not math.isfinite(factor) or factor <= 0:
        raise ValueError(f"rope scaling factor must be positive, got {factor}")
    if rope_type == "linear":
        return RopeConfig(theta=theta, rope_type="linear", factor=factor)
    return RopeConfig(
        theta=theta, rope_type="llama3", factor=factor,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )
