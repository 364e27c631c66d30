"""Configuration of gamma-titan models in Hugging Face form (written by `gamma-titan convert`)."""

from transformers import PretrainedConfig


class GammaConfig(PretrainedConfig):
    model_type = "gamma_titan"

    def __init__(self, vocab_size=4096, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=None, intermediate_size=704, rms_norm_eps=1e-12, rope_theta=10000.0,
                 max_position_embeddings=4096, attention_gate="elementwise",
                 # head_dim None: hidden_size / heads; qk_norm: an RMSNorm on each head's query and key
                 head_dim=None, qk_norm=False,
                 # attention = "mla": multi-head latent attention with these widths
                 attention="mha", q_lora_rank=0, kv_lora_rank=0, qk_nope_head_dim=0, qk_rope_head_dim=0,
                 v_head_dim=0,
                 # n_routed_experts > 0: layers from n_dense_layers on are mixtures of experts
                 n_routed_experts=0, n_shared_experts=0, num_experts_per_tok=1, moe_intermediate_size=0,
                 n_dense_layers=0, score_func="sigmoid", route_norm=True, route_scale=1.0, expert_bias=False,
                 score_before_experts=True,
                 # node-limited routing: experts in num_expert_groups groups, a token's top-k taken
                 # from the num_limited_groups groups whose two best scores sum highest; None: all
                 num_expert_groups=None, num_limited_groups=None, router_bias=False,
                 # Llama 3.1 RoPE scaling: {factor, low_freq_factor, high_freq_factor,
                 # original_max_position_embeddings}; None: plain RoPE
                 llama3_rope_scaling=None,
                 # DeepSeek's YaRN: {factor, original_max_position_embeddings, beta_fast, beta_slow,
                 # mscale}; None: plain RoPE
                 yarn_rope_scaling=None,
                 # RoPE on adjacent channel pairs (DeepSeek, TorchTitan's complex RoPE), not halves
                 rope_interleave=False,
                 # the final norm's ε: None = rms_norm_eps; "dtype" = the input dtype's machine epsilon
                 final_norm_eps=None, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.intermediate_size = intermediate_size
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.max_position_embeddings = max_position_embeddings
        self.attention_gate = attention_gate  # "none" | "headwise" | "elementwise"
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.qk_norm = qk_norm
        self.attention = attention
        self.q_lora_rank, self.kv_lora_rank = q_lora_rank, kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.n_routed_experts, self.n_shared_experts = n_routed_experts, n_shared_experts
        self.num_experts_per_tok, self.moe_intermediate_size = num_experts_per_tok, moe_intermediate_size
        self.n_dense_layers, self.score_func = n_dense_layers, score_func
        self.route_norm, self.route_scale, self.expert_bias = route_norm, route_scale, expert_bias
        self.score_before_experts = score_before_experts  # weight each expert's input (else its output)
        self.num_expert_groups, self.num_limited_groups = num_expert_groups, num_limited_groups
        self.router_bias = router_bias  # the router's linear map has a bias
        self.llama3_rope_scaling = llama3_rope_scaling
        self.yarn_rope_scaling = yarn_rope_scaling
        self.rope_interleave = rope_interleave
        self.final_norm_eps = final_norm_eps
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)
