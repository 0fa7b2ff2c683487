"""A tiny Llama written to a GGUF file with the gguf package's writer, as llama.cpp's converter writes one.

Float32 tensors (no quantization), so the model the file holds is exactly the HF model it was
written from. The names and the Q/K row order are llama.cpp's (``convert_hf_to_gguf.py``:
``blk.N.attn_q`` ..., Q and K rows permuted per head), which transformers' GGUF loader undoes
(``transformers/modeling_gguf_pytorch_utils.py``, ``LlamaTensorProcessor``). The vocabulary is
byte-level BPE (``tokenizer.ggml.model = gpt2``): the 256 byte symbols, two merges and an
end-of-text control token.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.convert_slow_tokenizer import bytes_to_unicode

MERGES = ["Ġ t", "h e"]
TOKENS = [*bytes_to_unicode().values(), "Ġt", "he", "<|endoftext|>"]
EOS_ID = len(TOKENS) - 1
TOKEN_NORMAL, TOKEN_CONTROL = 1, 3  # llama.cpp's token types


def tiny_gguf_llama(num_layers: int = 2, tie: bool = False) -> LlamaForCausalLM:
    """A seeded Llama over ``TOKENS``, large enough weights that every layer matters."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(TOKENS), hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         rope_theta=10000.0, rms_norm_eps=1e-5, initializer_range=0.2,
                         tie_word_embeddings=tie, bos_token_id=None, eos_token_id=EOS_ID)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms away from 1, so a norm read wrongly shows
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    return model


def write_gguf(model: LlamaForCausalLM, path: Path) -> Path:
    """Write ``model`` (a Llama over ``TOKENS``) and its tokenizer to ``path`` in float32."""
    import gguf  # the optional extra: callers skip without it (pytest.importorskip)

    config = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(TOKENS)
    writer.add_token_types([TOKEN_NORMAL] * (len(TOKENS) - 1) + [TOKEN_CONTROL])
    writer.add_token_merges(MERGES)
    writer.add_eos_token_id(EOS_ID)
    for name, tensor in _gguf_tensors(model).items():
        writer.add_tensor(name, tensor.detach().float().numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _gguf_tensors(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """llama.cpp's name for each of the model's tensors, Q and K rows in its order."""
    config, state = model.config, model.state_dict()
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    out = {"token_embd.weight": state["model.embed_tokens.weight"],
           "output_norm.weight": state["model.norm.weight"]}
    if not config.tie_word_embeddings:
        out["output.weight"] = state["lm_head.weight"]
    leaves = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for idx in range(config.num_hidden_layers):
        for hf_name, gguf_name in leaves.items():
            weight = state[f"model.layers.{idx}.{hf_name}.weight"]
            if gguf_name == "attn_q":
                weight = _permute(weight, heads)
            elif gguf_name == "attn_k":
                weight = _permute(weight, kv_heads)
            out[f"blk.{idx}.{gguf_name}.weight"] = weight
    return out


def _permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's row order for Q and K: each head's rotary halves interleaved."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
