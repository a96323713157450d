"""Small-config transformers and timm models for abp's model tests and memory table (no downloads).

``build(name, size)`` returns (model, make_input): transformers' BERT, RoBERTa, ViT, LLaMA, Qwen2,
Mistral, GPT-2, T5 encoder (gated GELU) and timm's ViT, dropout off. ``size="test"`` is tiny
(d 64, 2 layers); ``size="bench"`` is d 768, 2 layers, batch 2 x 128 tokens or 224^2 images (BERT/ViT-base widths).
"""
from __future__ import annotations

from typing import Callable, Dict, Tuple

import torch

ARCHITECTURES = ("bert", "roberta", "vit", "llama", "qwen2", "mistral", "gpt2", "t5", "timm_vit")

SIZES: Dict[str, Dict[str, int]] = {
    "test": dict(d=64, layers=2, heads=4, ff=128, tokens=12, batch=2, image=32, patch=8),
    "bench": dict(d=768, layers=2, heads=12, ff=3072, tokens=128, batch=2, image=224, patch=16),
}


def build(name: str, size: str = "test") -> Tuple[torch.nn.Module, Callable[[int], torch.Tensor]]:
    """(model, make_input(seed)) for architecture `name` at `size`; imports transformers/timm lazily."""
    s = SIZES[size]
    d, layers, heads, ff = s["d"], s["layers"], s["heads"], s["ff"]
    hidden = dict(hidden_size=d, num_hidden_layers=layers, num_attention_heads=heads, intermediate_size=ff)
    no_dropout = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)

    def ids(seed: int = 0) -> torch.Tensor:
        return torch.randint(0, 100, (s["batch"], s["tokens"]), generator=torch.Generator().manual_seed(seed))

    def pixels(seed: int = 0) -> torch.Tensor:
        return torch.randn(s["batch"], 3, s["image"], s["image"], generator=torch.Generator().manual_seed(seed))

    if name == "timm_vit":
        import timm

        model = timm.create_model("vit_base_patch16_224", pretrained=False, img_size=s["image"], patch_size=s["patch"],
                                  embed_dim=d, depth=layers, num_heads=heads, num_classes=10)
        return model, pixels
    import transformers as t

    if name == "bert":
        return t.BertModel(t.BertConfig(vocab_size=100, **hidden, **no_dropout)), ids
    if name == "roberta":
        return t.RobertaModel(t.RobertaConfig(vocab_size=100, **hidden, **no_dropout)), ids
    if name == "vit":
        return t.ViTModel(t.ViTConfig(image_size=s["image"], patch_size=s["patch"], **hidden, **no_dropout)), pixels
    kv = max(1, heads // 2)
    if name == "llama":
        return t.LlamaForCausalLM(t.LlamaConfig(vocab_size=100, num_key_value_heads=kv, **hidden)), ids
    if name == "qwen2":
        return t.Qwen2ForCausalLM(t.Qwen2Config(vocab_size=100, num_key_value_heads=kv, **hidden)), ids
    if name == "mistral":
        return t.MistralForCausalLM(t.MistralConfig(vocab_size=100, num_key_value_heads=kv, **hidden)), ids
    if name == "gpt2":
        config = t.GPT2Config(vocab_size=100, n_embd=d, n_layer=layers, n_head=heads, resid_pdrop=0.0, embd_pdrop=0.0,
                              attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        return t.GPT2LMHeadModel(config), ids
    if name == "t5":
        config = t.T5Config(vocab_size=100, d_model=d, d_kv=d // heads, d_ff=ff, num_layers=layers, num_heads=heads,
                            feed_forward_proj="gated-gelu", dropout_rate=0.0)
        return t.T5EncoderModel(config), ids
    raise KeyError(f"unknown architecture {name!r}; expected one of {', '.join(ARCHITECTURES)}")
