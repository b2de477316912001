"""Tiny random Hugging Face models, saved with save_pretrained into a directory: nothing
is downloaded. Used by tests/test_convert.py."""

from __future__ import annotations

import json
from pathlib import Path

VOCAB = 300
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def _save(model, directory: Path, dtype, shard_size: str | None, **kwargs) -> Path:
    import torch
    directory.mkdir(parents=True, exist_ok=True)
    model = model.to(dtype) if dtype is not None else model
    kwargs.update({"max_shard_size": shard_size} if shard_size else {})
    with torch.no_grad():
        model.save_pretrained(directory, **kwargs)
    return directory


def gpt2(directory: Path, *, seed: int = 0, dtype=None, shard_size: str | None = None,
         **overrides) -> Path:
    """GPT2LMHeadModel: 2 layers, 4 heads, embed 64, vocab 300, 64 positions."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    cfg = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64,
               bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)
    model = GPT2LMHeadModel(GPT2Config(**{**cfg, **overrides}))
    _randomize(model)
    return _save(model, directory, dtype, shard_size)


def llama(directory: Path, *, seed: int = 0, dtype=None, shard_size: str | None = None,
          scaling: dict | None = None, tied: bool = False, **overrides) -> Path:
    """LlamaForCausalLM: 2 layers, 4 heads over 2 kv heads, embed 64, mlp 128, vocab 300."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
               rope_theta=500_000.0 if scaling else 10_000.0, rope_scaling=scaling,
               tie_word_embeddings=tied, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(LlamaConfig(**{**cfg, **overrides}))
    _randomize(model)
    return _save(model, directory, dtype, shard_size)


def mixtral(directory: Path, *, seed: int = 0, dtype=None, shard_size: str | None = None,
            fused: bool = False, router_scale: float = 20.0, **overrides) -> Path:
    """MixtralForCausalLM: 2 layers, 4 heads over 2 kv heads, embed 64, 4 experts of mlp
    128, top-2, vocab 300. Saved as save_pretrained does by default (Mistral's names, one
    tensor per expert) or, `fused`, with transformers 5's in-memory names. The router's
    weights are scaled by `router_scale`: far from uniform routing, top-k is decided by
    the weights, and a router read wrongly changes the logits more."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM
    torch.manual_seed(seed)
    cfg = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=VOCAB,
               max_position_embeddings=64, rope_theta=1_000_000.0, rms_norm_eps=1e-5,
               tie_word_embeddings=False, router_aux_loss_coef=0.02, bos_token_id=1, eos_token_id=2)
    model = MixtralForCausalLM(MixtralConfig(**{**cfg, **overrides}))
    _randomize(model)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.mul_(router_scale)
    return _save(model, directory, dtype, shard_size, **({"save_original_format": False} if fused else {}))


def _randomize(model) -> None:
    """Norm scales and biases away from their 1 / 0 init, so a swapped or dropped one shows."""
    import torch
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))


def add_tokenizer(directory: Path, eos: str = "</s>", bos: bool = False) -> None:
    """A byte-level BPE tokenizer.json of exactly VOCAB ids, trained offline on a few
    lines, with "<s>" and `eos` as its special tokens (no "<|endoftext|>"); `bos`: its
    post-processor puts "<s>" first, as Llama's does (transformers' tokenizer(text))."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<s>", eos], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = ["the quick brown fox jumps over the lazy dog " * 3, "hello world, hello mesh " * 4,
            "training a tiny tokenizer for the tests of meshtrain convert " * 2]
    tok.train_from_iterator(text, trainer=trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos, "bos_token": "<s>"}))


def logits(directory: Path, tokens) -> "numpy.ndarray":  # noqa: F821
    """[B, T] int -> [B, T, V] float32 logits of the saved model, loaded in float32."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()


def loss(directory: Path, tokens_bt1) -> float:
    """Mean next-token cross entropy of the saved model (float32) on [B, T+1] tokens."""
    import numpy as np
    import torch
    out = logits(directory, np.asarray(tokens_bt1)[:, :-1])
    targets = torch.as_tensor(np.asarray(tokens_bt1)[:, 1:], dtype=torch.long)
    return float(torch.nn.functional.cross_entropy(torch.as_tensor(out).flatten(0, 1), targets.flatten()))


def greedy(directory: Path, prompt, max_new_tokens: int) -> tuple[list[int], float]:
    """transformers' greedy continuation of one prompt (float32, exactly max_new_tokens:
    no end-of-sequence stop), and the smallest gap between the top two logits on the way
    (how far the argmax was from a tie)."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    model.eval()
    ids = torch.as_tensor([list(prompt)], dtype=torch.long)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0,
                             output_scores=True, return_dict_in_generate=True)
    top2 = torch.stack(out.scores)[:, 0].topk(2, dim=-1).values
    return out.sequences[0, ids.shape[1]:].tolist(), float((top2[:, 0] - top2[:, 1]).min())
