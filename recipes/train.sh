#!/usr/bin/env bash
# The bundled model's whole training chain, resumable: run it again after an interruption (a
# killed session, or each 10-minute slice on a lent GPU) and every stage continues from its last
# checkpoint; finished stages return at once. Data and runs are regenerable, never committed.
#
#   recipes/train.sh                         # small (the bundled size), on the CPU
#   DEVICE=cuda recipes/train.sh             # the same recipes on a GPU
#   SIZE=tiny recipes/train.sh               # test size: the whole chain in minutes on a CPU
#   SET="--set train.steps=1400" recipes/train.sh   # extra overrides for every stage
#   NPROC=2 recipes/train.sh                 # each stage under torchrun on 2 processes (recipes/README.md)
#
# Stages: VAE -> prepare (VAE latents of the DiT's clips) -> A2V pre-training -> personality SFT
# (cross-scene references) -> CFG distillation (scales as inputs) -> SR refiner -> export to
# src/avatarstream/weights/avatarstream-$SIZE (bf16). synth needs espeak-ng and flite (apt); on a
# machine without them, bring data/ along.
set -euo pipefail
cd "$(dirname "$0")/.."
AV=${AV:-.venv/bin/avatarstream}
SIZE=${SIZE:-small}
DEVICE=${DEVICE:-cpu}
SET=${SET:-}
NPROC=${NPROC:-}
OUT=${OUT:-src/avatarstream/weights/avatarstream-$SIZE}
if [ "$SIZE" = tiny ]; then
  VAE_DATA="--identities 4 --clips-per-identity 2 --seconds 2 --size 64"
  DIT_DATA="--identities 6 --clips-per-identity 2 --seconds 2 --size 64"
else
  VAE_DATA="--identities 16 --clips-per-identity 3 --seconds 4"
  DIT_DATA="--identities 160 --clips-per-identity 3 --seconds 4"
fi
D=data/$SIZE
run() { $AV train "$1-$SIZE" --resume --device "$DEVICE" --no-progress ${NPROC:+--nproc $NPROC} $SET "${@:2}"; }

[ -f "$D/synth-vae/.done" ] || { $AV synth --out "$D/synth-vae" $VAE_DATA && touch "$D/synth-vae/.done"; }
[ -f "$D/synth-dit/.done" ] || { $AV synth --out "$D/synth-dit" $DIT_DATA --seed 1 && touch "$D/synth-dit/.done"; }
run vae --set "data.shards=\"$D/synth-vae\""
PREP=$D/prepared.safetensors
[ -f "$PREP" ] || $AV train prepare --shards "$D/synth-dit" --vae "runs/vae-$SIZE" --model "$SIZE" \
  --out "$PREP" --device "$DEVICE" --no-progress
P="--set data.prepared=\"$PREP\""
run a2v $P
run a2v-sft $P --set "init.dit=\"runs/a2v-$SIZE\"" --set "init.audio=\"runs/a2v-$SIZE\"" --set "init.text=\"runs/a2v-$SIZE\""
run cfg-distill $P --set "init.dit=\"runs/a2v-sft-$SIZE\"" --set "init.audio=\"runs/a2v-sft-$SIZE\"" \
  --set "init.text=\"runs/a2v-sft-$SIZE\""
run sr $P --set "init.audio=\"runs/a2v-sft-$SIZE\"" --set "init.text=\"runs/a2v-sft-$SIZE\""
$AV train export "runs/cfg-distill-$SIZE" "runs/a2v-sft-$SIZE" "runs/sr-$SIZE" --out "$OUT"
