"""Training (issue 5): recipes, trainer, data pre-encoding, export.

- `recipe`: TOML recipes (`recipes/*.toml`) with defaults and validation.
- `data`: synthetic shards -> pixels in memory (vae) or one pre-encoded latent file (a2v, sr);
  motion descriptors and mouth/eye loss weights from the annotations (training only).
- `tasks`: the stage objectives (`VAETask`, `A2VTask`, `SRTask`) matching the engine's calls.
- `optim`: Muon (Newton–Schulz orthogonalised momentum) + AdamW, cosine schedule with warmup.
- `trainer`: the loop — deterministic (seed, step) batches, bf16 autocast, EMA, atomic
  safetensors checkpoints, bit-for-bit resume, jsonl log, loss plots (`plot`).
- `export`: EMA weights of runs -> `weights/NAME/{dit,refiner,vae,audio,text}.safetensors` +
  `config.json` for the registry.
- `cli`: `avatarstream train RECIPE | prepare | export`.
"""
