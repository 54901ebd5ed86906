"""Tiny random-initialised transformers models of the architectures cupykv serves, for trying the Engine
without downloading weights, and for the tests: float32, transformers' eager attention (the reference the
tests compare against), weights drawn large enough that attention is peaked (a wrong key changes tokens).
"""
import torch

WINDOW = 8


def tiny_model(arch: str, *, window: int = WINDOW, layers: int = None, seed: int = 0, dtype=torch.float32):
    """A tiny random-initialised causal LM: arch one of ARCHS ("gemma3" 5 sliding : 1 full, "gpt_oss"
    alternating with learned sinks, "mistral" a window on every layer, "qwen2" sliding from
    max_window_layers on, "gemma2" alternating with soft-capping, "llama" full attention); vocabulary 128,
    64 hidden, 4 query and 2 KV heads of 16, eval mode, on the CPU."""
    import transformers as tf
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, max_position_embeddings=512, attn_implementation="eager",
                  initializer_range=0.2)       # peaked attention: a wrong key shows in the tokens
    if arch == "gemma3":          # 5 sliding : 1 full
        cfg = tf.Gemma3TextConfig(num_hidden_layers=layers or 6, sliding_window=window, **common)
        cls = tf.Gemma3ForCausalLM
    elif arch == "gpt_oss":       # alternating, learned sinks, mixture of experts
        cfg = tf.GptOssConfig(num_hidden_layers=layers or 4, sliding_window=window, num_local_experts=4,
                              num_experts_per_tok=2, **{**common, "max_position_embeddings": 131072})  # (its YaRN's)
        cls = tf.GptOssForCausalLM
    elif arch == "mistral":       # a window on every layer
        cfg = tf.MistralConfig(num_hidden_layers=layers or 3, sliding_window=window, **common)
        cls = tf.MistralForCausalLM
    elif arch == "qwen2":         # sliding layers from max_window_layers on
        cfg = tf.Qwen2Config(num_hidden_layers=layers or 4, sliding_window=window, use_sliding_window=True,
                             max_window_layers=2, **common)
        cls = tf.Qwen2ForCausalLM
    elif arch == "gemma2":        # alternating, attention logit soft-capping
        cfg = tf.Gemma2Config(num_hidden_layers=layers or 4, sliding_window=window, attn_logit_softcapping=5.0,
                              **common)
        cls = tf.Gemma2ForCausalLM
    elif arch == "llama":         # full attention everywhere
        cfg = tf.LlamaConfig(num_hidden_layers=layers or 3, **common)
        cls = tf.LlamaForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(cfg).eval().to(dtype)
    if arch == "gemma3":           # q and k are normalised: scale them up, or attention is nearly uniform
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.data.fill_(3.0)
            layer.self_attn.k_norm.weight.data.fill_(3.0)
    if arch == "gpt_oss":          # random sinks large enough to matter
        for layer in model.model.layers:
            layer.self_attn.sinks.data.normal_(0, 2)
    return model


ARCHS = ["gemma3", "gpt_oss", "mistral", "qwen2", "gemma2", "llama"]


def reference_tokens(model, prompt, max_new_tokens, eos_token_id=None):
    """Greedy tokens of model.generate with its own (eager) attention and cache (up to and with the first
    eos_token_id, when given)."""
    ids = torch.tensor([prompt], device=model.device)
    # an explicit mask: generate would take token 0 for padding where pad_token_id is 0
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=eos_token_id)
    return out[0, len(prompt):].tolist()
