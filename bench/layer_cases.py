"""The MoE layer cases of bench/py_layer.py and bench/peers_sonicmoe.py:
(name, tokens, hidden, ffn hidden, experts, top-k, MoELayer router
options); the shapes of the MLP benchmark (`moeflow bench mlp`: the same
rows per step). AUX: the aux-loss coefficient of every case."""
CASES = [
    ("dsv3", 8192, 7168, 2048, 32, 8,
     dict(score_function="sigmoid", num_groups=8, group_topk=4, use_expert_bias=True,
          topk_scaling_factor=2.5)),
    ("mixtral", 16384, 4096, 14336, 8, 2, dict(score_function="softmax")),
    ("qwen3-30b", 16384, 2048, 768, 128, 8, dict(score_function="softmax")),
]
AUX = 1e-2
