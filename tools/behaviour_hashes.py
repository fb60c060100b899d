"""Behaviour hashes: SHA-256 of the decoded frames of fixed-seed, single-thread runs of the bundled
model (issue 27: a redesign must leave them unchanged; bits depend on the CPU's kernels, so compare
hashes made on one machine, old and new code alternating).

    python tools/behaviour_hashes.py REPO OUT_DIR [prefix interp causal tpp live]

- prefix / interp / causal: `avatarstream generate` with examples/reference.png + speech.mp3,
  `--seed 0 --threads 1`, frames decoded back from the MP4 with PyAV;
- tpp: the same with `--strategy causal --workers 2` (equals causal: same frames);
- live: two live sessions (image and video reference, 4 s and 3 s of the example speech) batched
  by one ChunkScheduler, decode inline; frames hashed as published.
Prints one JSON line per run; OUT_DIR keeps the MP4s, the frames (.npy) and hashes.json.
The pre-redesign commit ran the same script with the live modules under `avatarstream.serve`.
"""
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
import numpy as np

REPO = Path(sys.argv[1])
OUT = Path(sys.argv[2])
AV = str(REPO / ".venv/bin/avatarstream")
EX = REPO / "examples"


def frames_of(mp4):
    import av
    with av.open(str(mp4)) as c:
        fr = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    return np.stack(fr)


def h(arr):
    return hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()


def gen(name, *extra):
    out = OUT / f"{name}.mp4"
    cmd = [AV, "generate", "--reference", str(EX / "reference.png"), "--audio", str(EX / "speech.mp3"),
           "--out", str(out), "--seed", "0", "--threads", "1", "--no-progress", *extra]
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    f = frames_of(out)
    np.save(OUT / f"{name}.npy", f)
    return {"frames": int(f.shape[0]), "sha256": h(f)}


def live():
    import torch
    torch.set_num_threads(1)
    from avatarstream.registry import load_model
    from avatarstream.media.reference import load_reference
    from avatarstream.media.audio import AudioReader
    from avatarstream.live.prepared import prepare_reference
    from avatarstream.live.scheduler import ChunkScheduler
    from avatarstream.live.segment import TalkSegment

    models = load_model("avatarstream-small")
    c = models.config
    refs = [load_reference(str(EX / "reference.png"), size=c.hr_size, max_frames=c.ref_pixel_frames).frames,
            load_reference(str(EX / "reference.mp4"), size=c.hr_size, max_frames=c.ref_pixel_frames).frames]
    prepared = [prepare_reference(models, r) for r in refs]
    wave = torch.cat([torch.as_tensor(x) for x in AudioReader(str(EX / "speech.mp3"), sample_rate=16000)])
    audios = [wave[: 16000 * 4], wave[16000 * 1: 16000 * 4]]
    text, mask = models.text.call("encode", [""])

    class Outlet:
        def __init__(self):
            self.frames = {}
        def put_video(self, frames, start_frame, fps):
            for i, f in enumerate(frames):
                self.frames[start_frame + i] = f
        def put_audio(self, *a):
            pass

    segs = []
    for p, a in zip(prepared, audios):
        o = Outlet()
        segs.append((TalkSegment(models, p, text, mask, iter(a.split(640)), o, start_frame=0), o))
    sched = ChunkScheduler(models, decode_overlap=False)
    batches = []
    while not all(s.done for s, _ in segs):
        items = []
        for s, _ in segs:
            if s.done:
                continue
            rec = s.plan()
            if rec is not None:
                items.append((rec, s))
        batches.append(len(items))
        sched.run_items(items)
    sched.stop()
    res = {}
    for i, (_, o) in enumerate(segs):
        f = np.stack([o.frames[k] for k in sorted(o.frames)])
        np.save(OUT / f"live{i}.npy", f)
        res[f"live{i}"] = {"frames": int(f.shape[0]), "sha256": h(f)}
    res["batches"] = batches
    return res


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    what = sys.argv[3:] or ["prefix", "interp", "causal", "tpp", "live"]
    res = {}
    for w in what:
        if w in ("prefix", "interp"):
            res[w] = gen(w, "--strategy", w)
        elif w == "causal":
            res[w] = gen(w, "--strategy", "causal")
        elif w == "tpp":
            res[w] = gen(w, "--strategy", "causal", "--workers", "2")
        elif w == "live":
            res["live"] = live()
        print(json.dumps({w: res.get(w)}), flush=True)
    (OUT / "hashes.json").write_text(json.dumps(res, indent=1))
