"""Tiny random mixture-of-experts models in HF transformers, written as GGUF files.

`Qwen3MoeForCausalLM` and `GptOssForCausalLM` in small configs with random weights (scaled so
activations and logits are O(1), not the near-zero outputs of their 0.02 init), then written the
way llama.cpp's convert_hf_to_gguf.py writes them: metadata keys through `hetero.synth`'s writer
(the keys its Qwen2MoeModel / GptOssModel set), tensors under llama.cpp's names, the experts as
3-D [E, N, K] tensors:

    qwen3moe   mlp.experts.gate_up_proj [E, 2F, C]   -> ffn_gate_exps [:, :F], ffn_up_exps [:, F:]
               mlp.experts.down_proj    [E, C, F]    -> ffn_down_exps
               mlp.gate.weight          [E, C]       -> ffn_gate_inp
    gpt-oss    mlp.experts.gate_up_proj [E, C, 2F]   gate and up interleaved along 2F:
                                                     gate_exps [..., ::2]^T, up_exps [..., 1::2]^T
               mlp.experts.gate_up_proj_bias [E, 2F] -> ffn_{gate,up}_exps.bias (::2, 1::2)
               mlp.experts.down_proj    [E, F, C]    -> ffn_down_exps = transposed [E, C, F]
               self_attn.sinks [H]                   -> attn_sinks.weight
               post_attention_layernorm              -> post_attention_norm

Quantized files are written from the same float weights; `load_weights_from` then gives the HF
model the file's dequantized values, so both sides compute with identical weights.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter

from hetero.quant import dequantize, quantize
from hetero.quant_mix import get_mix
from hetero.synth import add_model_metadata
from hetero.synth_shapes import ModelShape
from hetero.synth_vocab import add_vocab_metadata, build_vocab

T = GGMLQuantizationType
VOCAB = 512


def tiny_qwen3moe(seed: int = 0, **overrides):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = dict(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, moe_intermediate_size=512,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=2048,
        rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )  # fmt: skip
    return _randomized(Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**cfg, **overrides})), seed)


def tiny_gpt_oss(seed: int = 0, **overrides):
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = dict(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_local_experts=8,
        num_experts_per_tok=2, sliding_window=6, max_position_embeddings=131072,
        rms_norm_eps=1e-5, tie_word_embeddings=False,
    )  # fmt: skip
    return _randomized(GptOssForCausalLM(GptOssConfig(**{**cfg, **overrides})), seed)


def _randomized(model, seed: int):
    """Weights ~ N(0, 1/fan_in) (matrices), 1 + N(0, 0.1) (norms), N(0, 0.1) (biases),
    N(0, 1) (sinks), all float32."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1 or name.endswith("_bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:  # gpt-oss's experts multiply x @ W ([E, in, out]), the rest x @ W^T
                transposed = "experts" in name and model.config.model_type == "gpt_oss"
                fan_in = p.shape[-2] if transposed else p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(fan_in))
    return model.float().eval()


def shape_of(model) -> ModelShape:
    """The hetero.synth shape that writes this model's metadata."""
    c = model.config
    gpt_oss = c.model_type == "gpt_oss"
    common = dict(
        n_layers=c.num_hidden_layers, d_model=c.hidden_size, n_heads=c.num_attention_heads,
        n_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, d_ff=c.intermediate_size,
        vocab_size=c.vocab_size, context_length=c.max_position_embeddings,
        rope_theta=c.rope_parameters["rope_theta"], norm_eps=c.rms_norm_eps,
        tied_embeddings=False, n_experts_used=c.num_experts_per_tok,
    )  # fmt: skip
    if gpt_oss:
        rp = c.rope_parameters
        scaling = {
            "type": "yarn",
            "factor": rp["factor"],
            "original_max_position_embeddings": rp["original_max_position_embeddings"],
        }
        return ModelShape(
            arch="gpt-oss", attn_bias=True, n_experts=c.num_local_experts,
            d_ff_expert=c.intermediate_size, sliding_window=c.sliding_window,
            rope_scaling=scaling, **common,
        )  # fmt: skip
    return ModelShape(
        arch="qwen3moe", qk_norm=True, n_experts=c.num_experts,
        d_ff_expert=c.moe_intermediate_size, **common,
    )  # fmt: skip


def gguf_tensors(model) -> dict[str, torch.Tensor]:
    """llama.cpp's name -> float32 weight (numpy order), in the converter's layout."""
    sd = {k: v.detach().float() for k, v in model.state_dict().items()}
    out = {
        "token_embd.weight": sd["model.embed_tokens.weight"],
        "output_norm.weight": sd["model.norm.weight"],
        "output.weight": sd["lm_head.weight"],
    }
    gpt_oss = model.config.model_type == "gpt_oss"
    for i in range(model.config.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        out[b + "attn_norm.weight"] = sd[p + "input_layernorm.weight"]
        for hf, ours in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v")):
            out[f"{b}{ours}.weight"] = sd[f"{p}self_attn.{hf}.weight"]
            if gpt_oss:
                out[f"{b}{ours}.bias"] = sd[f"{p}self_attn.{hf}.bias"]
        out[b + "attn_output.weight"] = sd[p + "self_attn.o_proj.weight"]
        if gpt_oss:
            out |= _gpt_oss_layer(sd, p, b)
        else:
            out |= _qwen3moe_layer(sd, p, b)
    return out


def _qwen3moe_layer(sd: dict[str, torch.Tensor], p: str, b: str) -> dict[str, torch.Tensor]:
    gate_up = sd[p + "mlp.experts.gate_up_proj"]  # [E, 2F, C]
    f = gate_up.shape[1] // 2
    return {
        b + "attn_q_norm.weight": sd[p + "self_attn.q_norm.weight"],
        b + "attn_k_norm.weight": sd[p + "self_attn.k_norm.weight"],
        b + "ffn_norm.weight": sd[p + "post_attention_layernorm.weight"],
        b + "ffn_gate_inp.weight": sd[p + "mlp.gate.weight"],
        b + "ffn_gate_exps.weight": gate_up[:, :f],
        b + "ffn_up_exps.weight": gate_up[:, f:],
        b + "ffn_down_exps.weight": sd[p + "mlp.experts.down_proj"],  # [E, C, F]
    }


def _gpt_oss_layer(sd: dict[str, torch.Tensor], p: str, b: str) -> dict[str, torch.Tensor]:
    gate_up = sd[p + "mlp.experts.gate_up_proj"]  # [E, C, 2F], gate and up interleaved
    gate_up_b = sd[p + "mlp.experts.gate_up_proj_bias"]  # [E, 2F]
    return {
        b + "attn_output.bias": sd[p + "self_attn.o_proj.bias"],
        b + "attn_sinks.weight": sd[p + "self_attn.sinks"],
        b + "post_attention_norm.weight": sd[p + "post_attention_layernorm.weight"],
        b + "ffn_gate_inp.weight": sd[p + "mlp.router.weight"],
        b + "ffn_gate_inp.bias": sd[p + "mlp.router.bias"],
        b + "ffn_gate_exps.weight": gate_up[..., ::2].transpose(1, 2),
        b + "ffn_up_exps.weight": gate_up[..., 1::2].transpose(1, 2),
        b + "ffn_gate_exps.bias": gate_up_b[:, ::2],
        b + "ffn_up_exps.bias": gate_up_b[:, 1::2],
        b + "ffn_down_exps.weight": sd[p + "mlp.experts.down_proj"].transpose(1, 2),
        b + "ffn_down_exps.bias": sd[p + "mlp.experts.down_proj_bias"],
    }


def _type_for(name: str, weight: torch.Tensor, qtype: T) -> T:
    """qtype for the matrices (experts included), F32 for vectors, norms and the router; with
    MXFP4, as gpt-oss is released (llama.cpp's MXFP4_MOE): the experts only, Q8_0 elsewhere."""
    if weight.dim() < 2 or not name.endswith(".weight") or "ffn_gate_inp" in name:
        return T.F32
    if qtype == T.MXFP4 and weight.dim() == 2:
        return T.Q8_0
    return qtype


def write_gguf(
    model, path: Path, qtype: T = T.F32, seed: int = 0, shape: ModelShape | None = None
) -> Path:
    """The model as a GGUF file; matrices in `qtype` (vectors, norms, the router: F32).
    `shape`: metadata other than the model's (bad-input tests)."""
    shape = shape or shape_of(model)
    w = GGUFWriter(path, shape.arch)
    add_model_metadata(w, shape, get_mix("f32"), f"tiny {shape.arch}")
    add_vocab_metadata(w, build_vocab(shape.vocab_size, shape.tokenizer_pre, seed))
    for name, weight in gguf_tensors(model).items():
        arr = weight.contiguous().numpy().astype(np.float32)
        t = _type_for(name, weight, qtype)
        if t == T.F32:
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, quantize(arr, t), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def load_weights_from(model, path: Path) -> None:
    """Give the HF model the file's (dequantized) weights. gguf_tensors' tensors are views of
    the float32 model's parameters (slices and transposes), so writing them writes the model."""
    from hetero.gguf_loader import load_gguf

    gm = load_gguf(path)
    params = {p.data_ptr() for p in model.parameters()}
    with torch.no_grad():
        for name, weight in gguf_tensors(model).items():
            assert weight.untyped_storage().data_ptr() in params, f"{name} is not a view"
            t = gm.tensor(name)
            weight.copy_(dequantize(t.torch(), t.ggml_type, t.shape))
