"""MMDiT hyper-parameter presets (diffusers `SD3Transformer2DModel` config names).

The real SD3/SD3.5 shapes are here so that a pod run can be set up, sharded and inspected before
weights are at hand (`configs/inspect_mmdit.py:sd35_medium`); the small ones are for laptops and tests.
"""

_SD3_COMMON = dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, attention_head_dim=64,
                   joint_attention_dim=4096, pooled_projection_dim=2048)

PRESETS = {
    # Unit tests: 8x8 RGB, 16 tokens, two blocks (the last context-pre-only), dual attention on block 0.
    "tiny": dict(sample_size=8, patch_size=2, in_channels=3, out_channels=3, num_layers=2, attention_head_dim=16,
                 num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=32,
                 pos_embed_max_size=8, dual_attention_layers=(0,), qk_norm="rms_norm"),
    # The embedded world's base model: 32x32 RGB pixels, patch 4 -> 64 tokens, width 128, depth 6 (~3.4M),
    # sized so pretraining fits ~45 min on 2 CPU cores (WORKSPACE_NOTES.md).
    "shapes32": dict(sample_size=32, patch_size=4, in_channels=3, out_channels=3, num_layers=6, attention_head_dim=32,
                     num_attention_heads=4, joint_attention_dim=128, caption_projection_dim=128, pooled_projection_dim=128,
                     pos_embed_max_size=8, dual_attention_layers=(), qk_norm="rms_norm"),
    # Embedded-world scale: 32x32 RGB, patch 2 -> 256 tokens, width 256, depth 6 (~7M params).
    "small": dict(sample_size=32, patch_size=2, in_channels=3, out_channels=3, num_layers=6, attention_head_dim=64,
                  num_attention_heads=4, joint_attention_dim=128, caption_projection_dim=256, pooled_projection_dim=128,
                  pos_embed_max_size=32, dual_attention_layers=(), qk_norm="rms_norm"),
    # Issue 7's larger benchmark shape: width 512, depth 12, 256 tokens.
    "medium": dict(sample_size=32, patch_size=2, in_channels=3, out_channels=3, num_layers=12, attention_head_dim=64,
                   num_attention_heads=8, joint_attention_dim=256, caption_projection_dim=512, pooled_projection_dim=256,
                   pos_embed_max_size=32, dual_attention_layers=(), qk_norm="rms_norm"),
    "sd3_medium": dict(_SD3_COMMON, num_layers=24, num_attention_heads=24, caption_projection_dim=1536,
                       pos_embed_max_size=192, dual_attention_layers=(), qk_norm=None),
    "sd35_medium": dict(_SD3_COMMON, num_layers=24, num_attention_heads=24, caption_projection_dim=1536,
                        pos_embed_max_size=384, dual_attention_layers=tuple(range(13)), qk_norm="rms_norm"),
    "sd35_large": dict(_SD3_COMMON, num_layers=38, num_attention_heads=38, caption_projection_dim=2432,
                       pos_embed_max_size=192, dual_attention_layers=(), qk_norm="rms_norm"),
}
