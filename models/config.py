"""K3Config: the Kimi K3 family's configuration, parsed from the published `config.json` files.

Two layouts are read as they are published (`../shared/configs/`, shipped in `models/configs/`):
- nested `kimi_k3` (Kimi K3, K3.1 Pro): the language model under `text_config`, checkpoint keys prefixed with
  `language_model.`;
- flat `kimi_linear` (Kimi Linear 48B-A3B): no prefix.
Every field the model uses is validated; a missing or wrong field raises `ConfigError` naming the file and the
field path. Layer lists in `linear_attn_config` and `dsa_config` are 1-based (K3-SPEC.md, "Family members").
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3c.errors import ConfigError, shown


CONFIG_DIR = Path(__file__).resolve().parent / "configs"
PUBLISHED = {
    "k3": "kimi-k3.json",
    "k3.1-pro": "kimi-k3.1-pro.json",
    "kimi-linear-48b": "kimi-linear-48b-a3b.json",
}

_MISSING = object()


class _Fields:
    """Typed reads from one JSON object, with errors that name `source: path.to.field`."""

    def __init__(self, data: dict, source: str, path: str = ""):
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: {path or 'top level'}: expected a JSON object, found {type(data).__name__}")
        self.data, self.source, self.path = data, source, path

    def _name(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def get(self, key: str, kind: str, default: Any = _MISSING) -> Any:
        """Read `key` as `kind` in {int, pos_int, nonneg_int, float, pos_float, bool, str, int_list, obj}; integers
        are below 2^31 in magnitude, floats finite. Raises ConfigError naming the source, the field and the kind."""
        if key not in self.data or (self.data[key] is None and default is not _MISSING):
            if default is _MISSING:
                raise ConfigError(f"{self.source}: missing field '{self._name(key)}' (expected {kind})")
            return default
        value = self.data[key]
        def integer(v):  # sizes and indices: a bound that torch's shapes and int32 offsets keep
            return isinstance(v, int) and not isinstance(v, bool) and abs(v) < 2 ** 31

        def number(v):  # finite as a float: an integer literal of 400 digits is not
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                return False
            try:
                return math.isfinite(float(v))
            except OverflowError:
                return False

        ok = {
            "int": integer,
            "pos_int": lambda v: integer(v) and v > 0,
            "nonneg_int": lambda v: integer(v) and v >= 0,
            "float": number,
            "pos_float": lambda v: number(v) and v > 0,
            "bool": lambda v: isinstance(v, bool),
            "str": lambda v: isinstance(v, str),
            "int_list": lambda v: isinstance(v, list) and all(integer(x) for x in v),
            "obj": lambda v: isinstance(v, dict),
        }[kind]
        if not ok(value):
            bound = " (finite)" if kind.endswith("float") else " (below 2^31)" if "int" in kind else ""
            raise ConfigError(f"{self.source}: field '{self._name(key)}' must be {kind}{bound}, found {shown(value)}")
        return float(value) if kind in ("float", "pos_float") else value

    def sub(self, key: str, optional: bool = False) -> "_Fields | None":
        if optional and self.data.get(key) is None:
            return None
        return _Fields(self.get(key, "obj"), self.source, self._name(key))


@dataclass(frozen=True)
class K3Config:
    """The language model's configuration (all widths in elements, all lists 0-based after parsing).

    Attributes follow the published field names; derived schedule queries are methods. `raw` keeps the original
    JSON so a checkpoint writer can reproduce the published file.
    """

    name: str
    model_type: str  # "kimi_k3" | "kimi_linear"
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    hidden_act: str  # "situ" | "silu"
    situ_beta: float
    situ_linear_beta: float
    intermediate_size: int
    first_k_dense_replace: int
    moe_layer_freq: int
    num_experts: int
    num_experts_per_token: int
    num_shared_experts: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    moe_renormalize: bool
    routed_expert_hidden_size: int | None  # LatentMoE latent width; None = plain MoE on the hidden width
    attn_res_block_size: int | None  # None = plain residual (Kimi Linear)
    # global attention (MLA / DSA)
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    mla_use_output_gate: bool
    # KDA
    kda_num_heads: int
    kda_head_dim: int
    conv_kernel_size: int
    kda_layers: tuple[int, ...]  # 0-based
    gate_lower_bound: float | None  # None = Kimi Linear softplus gate
    use_full_rank_gate: bool
    # DSA (None when the model has no DSA layers)
    dsa_layers: tuple[int, ...] = ()
    index_num_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    expert_quantization: str | None = None  # "mxfp4" when routed experts ship as compressed-tensors MXFP4
    max_position_embeddings: int | None = None  # the longest context the model was trained for (tokens)
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    # ---- derived schedule ------------------------------------------------------------------------------------
    @property
    def checkpoint_prefix(self) -> str:
        """Key prefix of the language model in the published checkpoint (`language_model.` for kimi_k3)."""
        return "language_model." if self.model_type == "kimi_k3" else ""

    def layer_kind(self, i: int) -> str:
        """Token mixer of layer `i` (0-based): "kda", "dsa" or "mla" (K3-SPEC.md, "Family members")."""
        if i in self.kda_layers:
            return "kda"
        return "dsa" if i in self.dsa_layers else "mla"

    def is_moe(self, i: int) -> bool:
        """Layer `i` uses MoE when `i >= first_k_dense_replace` and `i % moe_layer_freq == 0`, else a dense MLP."""
        return i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0

    def seals_block(self, i: int) -> bool:
        """AttnRes seals the running partial sum as a block at layer `i` (`i % attn_res_block_size == 0`)."""
        return self.attn_res_block_size is not None and i % self.attn_res_block_size == 0

    @property
    def num_attn_res_sources(self) -> int:
        """Sources of the final AttnRes readout: sealed blocks + the partial sum (9 for full K3)."""
        if self.attn_res_block_size is None:
            return 0
        return sum(self.seals_block(i) for i in range(self.num_hidden_layers)) + 1

    @property
    def mla_cache_width(self) -> int:
        """Values cached per token per global layer: kv_lora_rank + qk_rope_head_dim (576 in K3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def moe_latent_size(self) -> int:
        return self.routed_expert_hidden_size or self.hidden_size

    def summary(self) -> dict:
        kinds = [self.layer_kind(i) for i in range(self.num_hidden_layers)]
        return {
            "name": self.name,
            "layers": self.num_hidden_layers,
            "kda": kinds.count("kda"),
            "mla": kinds.count("mla"),
            "dsa": kinds.count("dsa"),
            "moe": sum(self.is_moe(i) for i in range(self.num_hidden_layers)),
            "attn_res_sources": self.num_attn_res_sources,
        }

    # ---- parsing -----------------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict, source: str = "config", name: str | None = None) -> "K3Config":
        """Parse a published config dict. Raises ConfigError naming `source` and the field."""
        top = _Fields(data, source)
        model_type = top.get("model_type", "str")
        if model_type == "kimi_k3":
            f = top.sub("text_config")
        elif model_type == "kimi_linear":
            f = top
        else:
            raise ConfigError(f"{source}: field 'model_type' must be 'kimi_k3' or 'kimi_linear', found {model_type!r}")
        lin = f.sub("linear_attn_config")
        n_layers = f.get("num_hidden_layers", "pos_int")
        kda_1 = lin.get("kda_layers", "int_list")
        full_1 = lin.get("full_attn_layers", "int_list")
        _check_layers(source, f"{lin.path}.kda_layers", kda_1, n_layers)
        _check_layers(source, f"{lin.path}.full_attn_layers", full_1, n_layers)
        if sorted(kda_1 + full_1) != list(range(1, n_layers + 1)):
            raise ConfigError(f"{source}: {lin.path}.kda_layers and full_attn_layers must together cover layers "
                              f"1..{n_layers} exactly once")
        dsa = f.sub("dsa_config", optional=True)
        dsa_kw = {}
        if dsa is not None:
            dsa_1 = dsa.get("dsa_layers", "int_list")
            _check_layers(source, f"{dsa.path}.dsa_layers", dsa_1, n_layers)
            if not set(dsa_1) <= set(full_1):
                raise ConfigError(f"{source}: {dsa.path}.dsa_layers must be a subset of full_attn_layers")
            dsa_kw = dict(dsa_layers=tuple(i - 1 for i in dsa_1), index_num_heads=dsa.get("index_num_heads", "pos_int"),
                          index_head_dim=dsa.get("index_head_dim", "pos_int"), index_topk=dsa.get("index_topk", "pos_int"))
        act = f.get("hidden_act", "str")
        if act not in ("situ", "silu"):
            raise ConfigError(f"{source}: field '{f._name('hidden_act')}' must be 'situ' or 'silu', found {act!r}")
        if f.get("moe_router_activation_func", "str", "sigmoid") != "sigmoid":
            raise ConfigError(f"{source}: field '{f._name('moe_router_activation_func')}' must be 'sigmoid'")
        if f.get("num_expert_group", "pos_int", 1) != 1 or f.get("topk_group", "pos_int", 1) != 1:
            raise ConfigError(f"{source}: num_expert_group/topk_group other than 1 are not part of the K3 family")
        if not f.get("mla_use_nope", "bool", True):
            raise ConfigError(f"{source}: field '{f._name('mla_use_nope')}' must be true (the K3 family is NoPE)")
        n_exp, k_exp = f.get("num_experts", "pos_int"), f.get("num_experts_per_token", "pos_int")
        if k_exp > n_exp:
            raise ConfigError(f"{source}: num_experts_per_token ({k_exp}) exceeds num_experts ({n_exp})")
        cfg = cls(
            name=name or source,
            model_type=model_type,
            vocab_size=f.get("vocab_size", "pos_int"),
            hidden_size=f.get("hidden_size", "pos_int"),
            num_hidden_layers=n_layers,
            rms_norm_eps=f.get("rms_norm_eps", "pos_float"),
            tie_word_embeddings=f.get("tie_word_embeddings", "bool", False),
            hidden_act=act,
            situ_beta=f.get("activation_situ_beta", "pos_float", 4.0),
            situ_linear_beta=f.get("activation_situ_linear_beta", "pos_float", 25.0),
            intermediate_size=f.get("intermediate_size", "pos_int"),
            first_k_dense_replace=f.get("first_k_dense_replace", "nonneg_int", 0),
            moe_layer_freq=f.get("moe_layer_freq", "pos_int", 1),
            num_experts=n_exp,
            num_experts_per_token=k_exp,
            num_shared_experts=f.get("num_shared_experts", "nonneg_int", 0),
            moe_intermediate_size=f.get("moe_intermediate_size", "pos_int"),
            routed_scaling_factor=f.get("routed_scaling_factor", "pos_float", 1.0),
            moe_renormalize=f.get("moe_renormalize", "bool", True),
            routed_expert_hidden_size=f.get("routed_expert_hidden_size", "pos_int", None),
            attn_res_block_size=f.get("attn_res_block_size", "pos_int", None),
            num_attention_heads=f.get("num_attention_heads", "pos_int"),
            q_lora_rank=f.get("q_lora_rank", "pos_int", None),
            kv_lora_rank=f.get("kv_lora_rank", "pos_int"),
            qk_nope_head_dim=f.get("qk_nope_head_dim", "pos_int"),
            qk_rope_head_dim=f.get("qk_rope_head_dim", "nonneg_int"),
            v_head_dim=f.get("v_head_dim", "pos_int"),
            mla_use_output_gate=f.get("mla_use_output_gate", "bool", False),
            kda_num_heads=lin.get("num_heads", "pos_int"),
            kda_head_dim=lin.get("head_dim", "pos_int"),
            conv_kernel_size=lin.get("short_conv_kernel_size", "pos_int"),
            kda_layers=tuple(i - 1 for i in kda_1),
            gate_lower_bound=lin.get("gate_lower_bound", "float", None),
            use_full_rank_gate=lin.get("use_full_rank_gate", "bool", False),
            expert_quantization=_expert_quantization(f, source),
            max_position_embeddings=f.get("max_position_embeddings", "pos_int", None) or f.get(
                "model_max_length", "pos_int", None),
            raw=copy.deepcopy(data),
            **dsa_kw,
        )
        if cfg.gate_lower_bound is not None and cfg.gate_lower_bound >= 0:
            raise ConfigError(f"{source}: field '{lin._name('gate_lower_bound')}' must be negative")
        if dsa_kw and cfg.q_lora_rank is None:
            raise ConfigError(f"{source}: DSA's indexer reads the q-LoRA latent: q_lora_rank is required with dsa_config")
        return cfg

    @classmethod
    def from_pretrained(cls, path_or_preset: str | Path) -> "K3Config":
        """Load a preset name (see `PRESETS`), a `config.json` path, or a checkpoint directory holding one.

        Raises ConfigError for an unknown name, an unreadable file or invalid JSON.
        """
        key = str(path_or_preset)
        if key in PRESETS:
            return PRESETS[key]()
        if not key.strip():
            raise ConfigError(f"model {key!r}: expected a preset ({', '.join(sorted(PRESETS))}), a config.json or a "
                              "checkpoint directory")
        path = Path(key)
        if not path.exists() and (path.suffix == ".json" or len(path.parts) > 1):     # a path, not a preset name
            raise ConfigError(f"{key}: no such file or directory")
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise ConfigError(f"{key}: a checkpoint directory needs a config.json; none found")
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"{key}: not a preset ({', '.join(sorted(PRESETS))}), config.json or checkpoint directory")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: invalid JSON ({e.msg} at line {e.lineno})") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}); "
                              "a config.json is UTF-8 JSON") from None
        except (ValueError, RecursionError) as e:  # a number of more than 4300 digits; nesting deeper than Python's
            raise ConfigError(f"{path}: not a config JSON file ({shown(e)})") from None
        name = path.parent.name if path.name == "config.json" else path.stem
        return cls.from_dict(data, source=str(path), name=name or path.stem)


def _check_layers(source: str, name: str, layers: list[int], n_layers: int) -> None:
    bad = [i for i in layers if not 1 <= i <= n_layers]
    if bad or len(set(layers)) != len(layers):
        raise ConfigError(f"{source}: field '{name}' must list distinct 1-based layers in 1..{n_layers}, found {bad or 'duplicates'}")


def _expert_quantization(f: _Fields, source: str) -> str | None:
    q = f.sub("quantization_config", optional=True)
    if q is None:
        return None
    fmt = q.get("format", "str")
    if fmt != "mxfp4-pack-quantized" or q.get("quant_method", "str") != "compressed-tensors":
        raise ConfigError(f"{source}: field '{q.path}' must describe compressed-tensors 'mxfp4-pack-quantized', found {fmt!r}")
    return "mxfp4"


def load_published(name: str) -> dict:
    """The published config dict of `name` in PUBLISHED (a deep copy)."""
    return json.loads((CONFIG_DIR / PUBLISHED[name]).read_text())


def _text(data: dict) -> dict:
    return data["text_config"] if data["model_type"] == "kimi_k3" else data


def _shrink(name: str, base: str, **over: Any) -> K3Config:
    """A tiny config derived from a published one: same structure, small widths (for tests and examples)."""
    data = load_published(base)
    text = _text(data)
    lin = over.pop("linear_attn_config")
    dsa = over.pop("dsa_config", None)
    text.update(over)
    text["linear_attn_config"].update(lin)
    if dsa is not None:
        text["dsa_config"].update(dsa)
    text.pop("quantization_config", None)
    return K3Config.from_dict(data, source=f"preset {name}", name=name)


_TINY_COMMON = dict(vocab_size=512, hidden_size=64, num_hidden_layers=10, intermediate_size=128, num_experts=8,
                    num_experts_per_token=2, moe_intermediate_size=32, num_attention_heads=4, kv_lora_rank=32,
                    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
_TINY_LAYERS = dict(kda_layers=[1, 2, 3, 5, 6, 7, 9], full_attn_layers=[4, 8, 10], num_heads=4, head_dim=16)


def _k3_tiny(name: str = "k3-tiny", base: str = "k3", **extra: Any) -> K3Config:
    return _shrink(name, base, **_TINY_COMMON, q_lora_rank=32, routed_expert_hidden_size=32, attn_res_block_size=3,
                   num_shared_experts=2, linear_attn_config=dict(_TINY_LAYERS), **extra)


PRESETS = {
    # every structure of K3 at small width: 10 layers (7 KDA + 3 MLA), AttnRes blocks of 3 (5 readout sources)
    "k3-tiny": _k3_tiny,
    # K3.1 Pro at small width: DSA with top-k 16, so a 64-token prompt exercises the sparse path
    "k3.1-pro-tiny": lambda: _k3_tiny("k3.1-pro-tiny", "k3.1-pro", dsa_config=dict(
        index_num_heads=4, index_head_dim=16, index_topk=16, dsa_layers=[4, 8, 10])),
    # Kimi Linear at small width: softplus gate, low-rank gates, plain residual, SwiGLU MoE on the hidden width
    "kimi-linear-tiny": lambda: _shrink("kimi-linear-tiny", "kimi-linear-48b", **{**_TINY_COMMON, "num_hidden_layers": 8},
                                        q_lora_rank=None, num_shared_experts=1, linear_attn_config=dict(
                                            _TINY_LAYERS, kda_layers=[1, 2, 3, 5, 6, 7], full_attn_layers=[4, 8])),
    "k3": lambda: K3Config.from_dict(load_published("k3"), source=str(CONFIG_DIR / PUBLISHED["k3"]), name="k3"),
    "k3.1-pro": lambda: K3Config.from_dict(load_published("k3.1-pro"), source=str(CONFIG_DIR / PUBLISHED["k3.1-pro"]),
                                           name="k3.1-pro"),
    "kimi-linear-48b": lambda: K3Config.from_dict(load_published("kimi-linear-48b"), name="kimi-linear-48b",
                                                  source=str(CONFIG_DIR / PUBLISHED["kimi-linear-48b"])),
}
TINY_PRESETS = ("k3-tiny", "k3.1-pro-tiny", "kimi-linear-tiny")
