"""Checkpoints in the published layout: `config.json`, sharded `*.safetensors`, `model.safetensors.index.json`.

Key layout (K3-SPEC.md "Checkpoint layout"): language-model keys carry the `language_model.` prefix in kimi_k3
checkpoints and none in kimi_linear ones; vision keys are ignored. Routed experts are stored one tensor per expert
(`...experts.E.w1.weight`) or, when `quantization_config` says so, as compressed-tensors MXFP4:
`...experts.E.w1.weight_packed` uint8 [rows, cols/2] (two E2M1 codes per byte, element 2j in the low nibble) and
`...experts.E.w1.weight_scale` uint8 [rows, cols/32] (E8M0 exponents, scale = 2^(s-127)) (OCP Microscaling
Formats spec v1.0, §5.3.3 / §6.3). They are dequantized on load and stacked into `experts.w1/w2/w3`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from k3c.errors import CheckpointError
from models.config import K3Config

E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # OCP MX spec, Table 5 (FP4 E2M1)
MX_GROUP = 32
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(w[123])\.(weight|weight_packed|weight_scale)$")
_IGNORED = ("vision_tower.", "mm_projector.", "multi_modal_projector.")


# ---- MXFP4 -------------------------------------------------------------------------------------------------------
def mxfp4_dequantize(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """uint8 packed [R, C/2] + uint8 E8M0 scale [R, C/32] -> fp32 [R, C]."""
    lo, hi = packed & 0x0F, packed >> 4
    codes = torch.stack([lo, hi], -1).reshape(packed.shape[0], -1).long()  # element 2j = low nibble
    vals = E2M1_VALUES.to(packed.device)[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    exp = torch.exp2(scale.float() - 127).repeat_interleave(MX_GROUP, dim=1)
    return vals * exp


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [R, C] (C a multiple of 32) -> (packed uint8 [R, C/2], scale uint8 [R, C/32]).

    Per 32-value group the shared exponent is the smallest s with amax / 2^s <= 6 (E2M1's largest value); each
    value is rounded to the nearest E2M1 magnitude.
    """
    R, C = w.shape
    if C % MX_GROUP:
        raise CheckpointError(f"MXFP4 needs a row length that is a multiple of {MX_GROUP}, found {C}")
    g = w.float().reshape(R, C // MX_GROUP, MX_GROUP)
    amax = g.abs().amax(-1).clamp(min=2.0 ** -126)
    s = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    q = g / torch.exp2(s).unsqueeze(-1)
    code = (q.abs().unsqueeze(-1) - E2M1_VALUES.to(w.device)).abs().argmin(-1) + torch.where(q < 0, 8, 0)
    code = code.reshape(R, C).to(torch.uint8)
    return (code[:, 0::2] | (code[:, 1::2] << 4)).contiguous(), (s + 127).to(torch.uint8)


# ---- expected layout ---------------------------------------------------------------------------------------------
def expected_tensors(cfg: K3Config) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Checkpoint key -> (shape, dtype class) the model needs, with routed experts listed per expert."""
    from models.k3 import K3ForCausalLM

    with torch.device("meta"):
        model = K3ForCausalLM(cfg)
    out = {}
    for name, p in model.named_parameters():
        key = cfg.checkpoint_prefix + name
        m = re.match(r"^(.*\.experts)\.(w[123])$", name)
        if not m:
            out[key] = (tuple(p.shape), p.dtype)
            continue
        for e in range(p.shape[0]):
            base = f"{cfg.checkpoint_prefix}{m.group(1)}.{e}.{m.group(2)}"
            if cfg.expert_quantization == "mxfp4":
                out[base + ".weight_packed"] = ((p.shape[1], p.shape[2] // 2), torch.uint8)
                out[base + ".weight_scale"] = ((p.shape[1], p.shape[2] // MX_GROUP), torch.uint8)
            else:
                out[base + ".weight"] = (tuple(p.shape[1:]), p.dtype)
    return out


def index_weight_map(path: Path) -> dict[str, str] | None:
    """The `weight_map` (tensor name -> shard file name) of checkpoint directory `path`'s
    model.safetensors.index.json, or None without one. Raises CheckpointError naming the index when it is not JSON
    with a 'weight_map' object of plain file names (no directories: a shard lies in `path`)."""
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        return None
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
        weight_map = None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index}: expected JSON with a 'weight_map' object of tensor name -> shard file name")
    for key, name in weight_map.items():
        if name in ("", ".", "..") or "/" in name or "\\" in name:
            raise CheckpointError(f"{index}: weight_map maps '{key}' to {name!r}; shard names are plain file names "
                                  f"in the checkpoint directory {path}")
    return weight_map


def open_shard(shard: Path):
    """`safe_open(shard)` (torch framework) as a context manager; raises CheckpointError naming the file when it is
    not a readable safetensors file."""
    try:
        return safe_open(str(shard), framework="pt")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{shard}: not a readable safetensors file ({e})") from None


def _shard_files(path: Path) -> list[Path]:
    weight_map = index_weight_map(path)
    if weight_map is not None:
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files and no model.safetensors.index.json")
    missing = [f for f in files if not (path / f).is_file()]
    if missing:
        raise CheckpointError(f"{path}: shard(s) named in the index are missing: {', '.join(missing)}")
    return [path / f for f in files]


def _read_shard(shard: Path, cfg: K3Config, expected: dict, found: dict, weight_map: dict | None) -> None:
    """Add the model tensors of `shard` to `found`; with the index's `weight_map`, each must be mapped to this
    shard (a consumer that reads one tensor through the index would miss it otherwise)."""
    with open_shard(shard) as f:
        for key in f.keys():
            if key.startswith(_IGNORED) or (cfg.checkpoint_prefix and not key.startswith(cfg.checkpoint_prefix)):
                continue  # vision tower and other towers of a multimodal checkpoint
            if key not in expected:
                raise CheckpointError(f"{shard}: unexpected tensor '{key}' of shape {f.get_slice(key).get_shape()} "
                                      f"(not part of a {cfg.model_type} model with this config)")
            if weight_map is not None and weight_map.get(key) != shard.name:
                where = f"maps it to {weight_map[key]}" if key in weight_map else "does not list it"
                raise CheckpointError(f"{shard.parent / 'model.safetensors.index.json'}: tensor '{key}' is in "
                                      f"{shard.name} but the weight_map {where}")
            found[key] = f.get_tensor(key)


def load_checkpoint(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """Load a checkpoint directory in the published layout into a `K3ForCausalLM`.

    MXFP4 experts are dequantized; A_log may be stored longer than H (zero-padded, e.g. Kimi Linear's [1,1,H,1]):
    its first H values are used. Parameters are cast to `dtype` except the fp32 ones (A_log, dt_bias, convs,
    o_norm). Raises CheckpointError for a missing, extra (non-vision), mis-shaped or non-finite tensor (MXFP4
    experts whose scales make a value NaN or Inf: `mxfp4_nonfinite`), naming the key with expected and found
    shapes, or one the index's weight_map places in another shard; ConfigError for a bad config.json.
    """
    from models.k3 import K3ForCausalLM

    path = Path(path)
    cfg = K3Config.from_pretrained(path)
    expected = expected_tensors(cfg)
    found: dict[str, torch.Tensor] = {}
    weight_map = index_weight_map(path)
    for shard in _shard_files(path):
        try:
            _read_shard(shard, cfg, expected, found, weight_map)
        except SafetensorError as e:  # truncated or corrupt file: name it instead of a traceback
            raise CheckpointError(f"{shard}: not a readable safetensors file ({e})") from None
    missing = sorted(set(expected) - set(found))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{path}: missing tensor '{missing[0]}' of shape {list(expected[missing[0]][0])}{more}")
    for key, t in found.items():
        shape = expected[key][0]
        if key.endswith("A_log") and t.numel() >= shape[0]:
            found[key] = t.reshape(-1)[:shape[0]]
        elif tuple(t.shape) != shape:
            raise CheckpointError(f"{path}: tensor '{key}' has shape {list(t.shape)}, expected {list(shape)}")
        if expected[key][1].is_floating_point != t.is_floating_point():  # e.g. weights saved as integers
            want = "a floating-point dtype" if expected[key][1].is_floating_point else str(expected[key][1])
            raise CheckpointError(f"{path}: tensor '{key}' has dtype {t.dtype}, expected {want}")
        if t.is_floating_point() and not torch.isfinite(t.float()).all():
            raise CheckpointError(f"{path}: tensor '{key}' contains NaN or Inf values")
    for key, t in found.items():
        if key.endswith(".weight_packed"):
            _check_mxfp4_finite(path, key, t, found[key.replace("weight_packed", "weight_scale")])
    with torch.device("meta"):
        model = K3ForCausalLM(cfg)
    state = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for key, t in found.items():
        name = key[len(cfg.checkpoint_prefix):]
        m = _EXPERT.match(name)
        if m is None:
            state[name] = t
        elif m.group(4) != "weight_scale":
            w = mxfp4_dequantize(t, found[key.replace("weight_packed", "weight_scale")]) if m.group(4) == "weight_packed" else t
            experts.setdefault(f"{m.group(1)}.{m.group(3)}", {})[int(m.group(2))] = w
    for name, per in experts.items():
        state[name] = torch.stack([per[e] for e in range(len(per))])
    model.load_state_dict({k: v.float() for k, v in state.items()}, assign=True, strict=True)
    return model.cast_(dtype).to(device)


def mxfp4_nonfinite(packed: torch.Tensor, scale: torch.Tensor) -> int:
    """How many values of MXFP4 rows (uint8 packed [R, C/2], uint8 E8M0 scale [R, C/32]) are not finite in f32
    (and bf16, which has f32's exponent range): all 32 of a group whose scale byte is 255 (the one NaN of
    E8M0, OCP Microscaling Formats v1.0), and those whose E2M1 magnitude times 2^(s − 127) reaches 2^128: magnitudes ≥ 4 at s = 253, ≥ 2
    at s = 254 (the largest, 6, stays finite up to s = 252). Reads only the groups with s ≥ 253."""
    rows, groups = (scale >= 253).nonzero(as_tuple=True)
    if rows.numel() == 0:
        return 0
    s = scale[rows, groups].long()
    pairs = packed.reshape(packed.shape[0], -1, MX_GROUP // 2)[rows, groups]          # [G, 16] bytes
    magnitude = E2M1_VALUES.to(packed.device)[torch.stack([pairs & 7, (pairs >> 4) & 7], -1).long()]
    limit = torch.where(s == 253, 4.0, torch.where(s == 254, 2.0, 0.0))               # 255: every value
    return int((magnitude.reshape(len(s), -1) >= limit[:, None]).sum())


def _check_mxfp4_finite(path: Path, packed_key: str, packed: torch.Tensor, scale: torch.Tensor) -> None:
    """Raise CheckpointError naming the scale tensor of `packed_key` if its scales make values non-finite
    (`mxfp4_nonfinite`): the check of the dense tensors' NaN and Inf, for MXFP4 experts."""
    n = mxfp4_nonfinite(packed, scale)
    if n:
        scale_key = packed_key.replace("weight_packed", "weight_scale")
        raise CheckpointError(f"{path}: tensor '{scale_key}' makes {n} value(s) of '{packed_key}' NaN or Inf: "
                              "E8M0 byte 255 is NaN, and 253 / 254 overflow times E2M1 magnitudes ≥ 4 / ≥ 2")


def load_mxfp4_experts(path: str | Path) -> dict[str, torch.Tensor]:
    """The MXFP4 routed experts of checkpoint `path` as stored, stacked over experts: model parameter key +
    ".weight_packed" -> uint8 [E, R, C/2] and + ".weight_scale" -> uint8 [E, R, C/32] (e.g.
    `layers.3.mlp.experts.w1.weight_packed`), the bits of the checkpoint's `...experts.<e>.w1.weight_packed`.

    Reads only those tensors. Raises CheckpointError when the checkpoint does not store MXFP4 experts or one is
    missing, mis-shaped, or its scales make a value NaN or Inf (`mxfp4_nonfinite`; `load_checkpoint` checks the
    rest).
    """
    path = Path(path)
    cfg = K3Config.from_pretrained(path)
    if cfg.expert_quantization != "mxfp4":
        raise CheckpointError(f"{path}: config.json has no MXFP4 quantization_config; its experts are dense")
    expected = {k: v for k, v in expected_tensors(cfg).items() if _EXPERT.match(k[len(cfg.checkpoint_prefix):])}
    found: dict[str, torch.Tensor] = {}
    for shard in _shard_files(path):
        with open_shard(shard) as f:
            for key in f.keys():
                if key in expected:
                    found[key] = f.get_tensor(key)
    per: dict[str, dict[int, torch.Tensor]] = {}
    for key, (shape, dtype) in expected.items():
        t = found.get(key)
        if t is None or tuple(t.shape) != shape or t.dtype != dtype:
            got = "missing" if t is None else f"{t.dtype}{list(t.shape)}"
            raise CheckpointError(f"{path}: tensor '{key}' is {got}, expected {dtype}{list(shape)}")
        m = _EXPERT.match(key[len(cfg.checkpoint_prefix):])
        per.setdefault(f"{m.group(1)}.{m.group(3)}.{m.group(4)}", {})[int(m.group(2))] = t
    for key in expected:
        if key.endswith(".weight_packed"):
            _check_mxfp4_finite(path, key, found[key], found[key.replace("weight_packed", "weight_scale")])
    return {k: torch.stack([v[e] for e in range(len(v))]) for k, v in sorted(per.items())}


def quantize_experts_(model) -> dict[str, torch.Tensor]:
    """Round the routed experts of `model` (a K3ForCausalLM) to MXFP4 in place (`mxfp4_quantize`, then the
    dequantized values in the parameters' dtype) and return their packed form keyed like `load_mxfp4_experts`.
    Raises CheckpointError naming the expert matrix and its row length when that is not a multiple of 32."""
    out = {}
    for name, p in model.named_parameters():
        if re.match(r"^.*\.experts\.w[123]$", name):
            if p.shape[-1] % MX_GROUP:
                width = "moe_intermediate_size" if name.endswith("w2") else "the experts' input width"
                raise CheckpointError(f"{name} {list(p.shape)}: MXFP4 stores each row in groups of {MX_GROUP} "
                                      f"values, and these rows ({width}) are {p.shape[-1]} long; use dense experts "
                                      "(--experts-dtype bf16)")
            packed, scale = mxfp4_quantize(p.detach().float().flatten(0, 1))
            out[name + ".weight_packed"] = packed.reshape(*p.shape[:2], -1)
            out[name + ".weight_scale"] = scale.reshape(*p.shape[:2], -1)
            p.data.copy_(mxfp4_dequantize(packed, scale).reshape(p.shape).to(p.dtype))
    return dict(sorted(out.items()))


def save_random_checkpoint(config: K3Config | str, path: str | Path, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                           expert_format: str | None = None, shard_bytes: int = 2 * 2**20,
                           device: str | torch.device = "cpu"):
    """Write a deterministic random checkpoint of `config` in the published layout; returns the model it holds
    (on `device`, where its weights are drawn: `K3ForCausalLM.init_random_`).

    `expert_format`: "mxfp4" or "dense"; by default MXFP4 when the config has a quantization_config. The returned
    model (fp32) holds exactly the values a later `load_checkpoint` reads (MXFP4 rounding included). The
    directory is written atomically: a temp directory renamed into place, removed if anything fails. Raises
    CheckpointError for an existing `path`, an unknown `expert_format` or a shard that cannot be written (naming
    it: a full disk), OSError where the directory or its small files cannot be.
    """
    from models.k3 import K3ForCausalLM

    cfg = config if isinstance(config, K3Config) else K3Config.from_pretrained(config)
    fmt = expert_format or (cfg.expert_quantization or "dense")
    if fmt not in ("mxfp4", "dense"):
        raise CheckpointError(f"expert_format must be 'mxfp4' or 'dense', found {fmt!r}")
    raw = json.loads(json.dumps(cfg.raw))
    text = raw["text_config"] if cfg.model_type == "kimi_k3" else raw
    if fmt == "mxfp4" and "quantization_config" not in text:
        text["quantization_config"] = json.loads(json.dumps(_MXFP4_QUANT))
    if fmt == "dense":
        text.pop("quantization_config", None)
    cfg = K3Config.from_dict(raw, source=cfg.name, name=cfg.name)
    with torch.device(device):
        model = K3ForCausalLM(cfg)
    model.init_random_(seed, device).cast_(dtype)
    packed = quantize_experts_(model) if fmt == "mxfp4" else {}
    tensors: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        m = re.match(r"^(.*\.experts)\.(w[123])$", name)
        if not m:
            tensors[cfg.checkpoint_prefix + name] = p.detach().contiguous()
            continue
        for e in range(p.shape[0]):
            base = f"{cfg.checkpoint_prefix}{m.group(1)}.{e}.{m.group(2)}"
            if fmt == "mxfp4":
                for suffix in ("weight_packed", "weight_scale"):
                    tensors[f"{base}.{suffix}"] = packed[f"{name}.{suffix}"][e].contiguous()
            else:
                tensors[base + ".weight"] = p[e].detach().contiguous()
    path = Path(path)
    if path.exists():
        raise CheckpointError(f"{path}: already exists; refusing to overwrite a checkpoint")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        shards, cur, size = [], {}, 0
        for key in sorted(tensors):
            cur[key] = tensors[key]
            size += tensors[key].numel() * tensors[key].element_size()
            if size >= shard_bytes:
                shards.append(cur)
                cur, size = {}, 0
        if cur:
            shards.append(cur)
        weight_map = {}
        for n, shard in enumerate(shards):
            fname = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
            try:
                save_file(shard, str(tmp / fname), metadata={"format": "pt"})
            except SafetensorError as err:      # safetensors reports an I/O error (a full disk) as its own type
                raise CheckpointError(f"cannot write checkpoint file {fname} of {path}: {err}") from None
            weight_map.update({k: fname for k in shard})
        (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map},
                                                                      indent=2, sort_keys=True) + "\n")
        (tmp / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
        umask = os.umask(0)
        os.umask(umask)
        for f in tmp.iterdir():  # the permissions of a plain mkdir / open, not mkdtemp's private 0700
            os.chmod(f, 0o666 & ~umask)
        os.chmod(tmp, 0o777 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return model.cast_(torch.float32)


_MXFP4_QUANT = {
    "format": "mxfp4-pack-quantized", "quant_method": "compressed-tensors",
    "config_groups": {"group_0": {"format": "mxfp4-pack-quantized", "targets": ["Linear"], "input_activations": None,
                                  "weights": {"num_bits": 4, "group_size": 32, "type": "float", "scale_dtype": "uint8"}}},
    "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*", "re:.*lm_head.*"],
}
