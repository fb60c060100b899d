"""Training (issue 5): recipes, trainer, data pre-encoding, export. Nothing on the inference path
imports this package.

- `recipe`: TOML recipes (`recipes/*.toml`) with defaults and validation.
- `data`: synthetic shards -> pixels in memory (vae) or one pre-encoded latent file (a2v, sr);
  motion descriptors and mouth/eye loss weights from the annotations (training only).
- `nets`: the networks at the presets' sizes and their from-scratch init (`vae_init`: the VAE's
  pooling init and latent-statistics folding).
- `objectives/`: one file per stage objective (vae, a2v, cfg-distill, sr, df, dmd) matching the
  engine's calls, and the registry `make_task` reads.
- `optim`: torch's Muon for the blocks' matrices + AdamW for the rest, cosine schedule with warmup.
- `checkpoints`: atomic safetensors checkpoints of a run folder, starting weights (`[init]`).
- `trainer`: the loop — deterministic (seed, step) batches, bf16 autocast, EMA, bit-for-bit
  resume, jsonl log, loss plots (`plot`).
- `human`: the expert (lip-sync, identity) auxiliary losses of the a2v recipes.
- `export`: EMA weights of runs -> `weights/NAME/{dit,refiner,vae,audio,text}.safetensors` +
  `config.json` for the registry.
- `personality`: `train personality`, a LoRA fitting a model (ours, FlashHead, LiveAvatar) to one
  person's footage on cross-scene pairs (`personality_data`: footage and pairs;
  `personality_families`: each family's flow-matching objective).
- `cli`: `avatarstream train RECIPE | prepare | export | personality`.
"""
