"""Evaluation harness (issue 4, items 4 and 6): expert models that judge pixels and audio only
(`experts`: face-state regressor, SyncNet-style lip-sync expert, identity encoder; trained by
`train_experts` on the synthetic train split, weights in `avatarstream/assets/experts/`), metrics
(`metrics`: Sync-C/Sync-D/offset, FaceSim, style error, mouth closed in silence, chunk-boundary
smoothness, PSNR/SSIM, drift by time window), reports (`report`: Markdown + PNG plots), the
held-out benchmark (`benchmark`) and `avatarstream eval` (`cli`).
"""
