"""Hair of a synthetic avatar, painted once per renderer in sprite (head) space: a back layer
(behind face and neck: long hair, buns, the far side of big hair) and a front layer (cap, fringe,
curtains framing the face), both premultiplied RGBA."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from avatarstream.data.draw import F32, coverage, sd_ellipse, smoothstep, value_noise
from avatarstream.data.identity import Identity

# style -> (hairline height at the forehead, cap bottom at the sides, cap half-width, length of the
# hair below the face (None = short), curl amount)
STYLES: dict[str, tuple[float, float, float, float | None, float]] = {
    "short": (-0.78, 0.05, 1.06, None, 0.0), "crop": (-0.82, 0.0, 1.015, None, 0.0),
    "long": (-0.74, 0.05, 1.08, 2.1, 0.0), "wavy": (-0.72, 0.05, 1.12, 1.9, 0.35),
    "bob": (-0.72, 0.05, 1.12, 1.05, 0.0), "bangs": (-0.42, 0.05, 1.1, 1.5, 0.0),
    "bun": (-0.86, -0.05, 1.04, None, 0.0), "curly": (-0.8, 0.12, 1.14, None, 1.0),
    "afro": (-0.84, 0.5, 1.45, None, 1.0), "bald": (-1.6, -0.05, 1.04, None, 0.0),
    "receding": (-1.02, 0.0, 1.05, None, 0.0)}


@dataclass
class HairLayers:
    """Premultiplied hair layers in sprite space: back/front RGB [3, H, W] and alpha [H, W]."""

    back_p: np.ndarray
    back_a: np.ndarray
    front_p: np.ndarray
    front_a: np.ndarray


def paint_hair(idn: Identity, face_d: np.ndarray, u: np.ndarray, v: np.ndarray, px: float,
               light: np.ndarray, light_rgb: np.ndarray, ambient: float) -> HairLayers:
    """Hair for one identity. face_d [H, W] signed distance of the face; u, v [H, W] head coords;
    light [3] unit vector; light_rgb [3] direct light colour × intensity."""
    rng = np.random.default_rng([idn.seed & 0xFFFFFFFF, 0x4A])
    h, w = u.shape
    st = idn.hair_style
    h0, side_cut, cap_w, length, curl = STYLES[st]
    vol, cr = idn.hair_volume, idn.cranium
    part = float(rng.uniform(-0.35, 0.35))
    # hairline: a curve across the forehead reaching the temples; bangs are flat and low
    if st == "bangs":
        hl = h0 + 0.02 * np.sin(u * 23.0 + part * 7) + 0.6 * smoothstep(0.55, 1.0, np.abs(u))
    else:
        hl = h0 + (-0.1 - h0) * np.clip(np.abs(u - 0.3 * part) / 0.92, 0, 1) ** 2
        hl = hl + 0.03 * np.sin(u * 9.0 + part * 5) * (1 + curl)
        if st == "receding":
            hl = hl - 0.22 * np.maximum(1 - ((np.abs(u) - 0.45) / 0.25) ** 2, 0) ** 2
    soft = 3.0 if st == "crop" else 1.0
    below = smoothstep(-soft * px, soft * px, v - hl)
    ang = np.arctan2(u, -(v + 0.25))  # 0 straight up
    bumps = (0.05 + 0.03 * curl) * np.sin(ang * 13.0 + part * 3) * curl
    top = -0.2 - (cr + 0.12) * (1.0 if st not in ("crop", "bun") else 0.9) * (1.0 if st != "afro" else 1.08)
    cy = -0.35 if st == "afro" else -0.2
    cap_d = sd_ellipse(u, v - cy, cap_w * vol, (cy - top) * vol) - bumps
    if st in ("crop", "bun"):  # close to the skull
        cap_d = sd_ellipse(u, v, 1.0, cr) - (0.03 if st == "crop" else 0.07)
    cap = coverage(cap_d, px) * smoothstep(side_cut + px, side_cut - px, v)
    back = np.zeros((h, w), F32)
    inset = 0.0 if length is None else 0.08
    face_open = below * coverage(face_d + inset, px)
    if length is not None:
        wav = 0.05 * np.sin(v * 7.0 + part * 4) * (curl + 0.2) * smoothstep(-0.2, 0.6, v)
        big_d = sd_ellipse(u, v - (length - 1.45) / 2, cap_w * 1.12 * vol + wav, (length + 1.45) / 2 + 0.1)
        big = coverage(big_d, px) * smoothstep(length + px, length - 0.3, v)
        if st == "bob":
            big = coverage(big_d, px) * smoothstep(length + px, length - px, v)
        corridor = smoothstep(idn.neck_width + 0.18, idn.neck_width + 0.12, np.abs(u)) * smoothstep(0.7, 0.9, v)
        opening = np.maximum(face_open, corridor)
        front = np.maximum(cap * (1 - face_open), big * (1 - opening))
        back = big
    elif st == "bald":  # a thin crescent above the ears
        horse = coverage(cap_d, px) * smoothstep(-0.75, -0.4, v) * smoothstep(0.06, -0.04, v)
        front = 0.9 * horse * smoothstep(0.72, 0.92, np.abs(u))
    else:
        front = cap * (1 - face_open)
        if st in ("afro", "curly"):
            back = cap
    if st == "bun":
        bun_d = sd_ellipse(u, v - (top - 0.22), 0.36 * vol, 0.32 * vol) - 0.02 * np.sin(ang * 17)
        back = np.maximum(back, coverage(bun_d, px))
    alpha_scale = 0.8 if st == "crop" else 1.0
    front = front * alpha_scale
    # shading: an ellipsoid around the head, strands radiating from the part, curls for curly hair
    nx, ny = u / (1.25 * vol), (v + 0.3) / 1.6
    nz = np.sqrt(np.maximum(1.0 - nx * nx - ny * ny, 0.05))
    inv = 1.0 / np.sqrt(nx * nx + ny * ny + nz * nz)
    nx, ny, nz = nx * inv, ny * inv, nz * inv
    lam = np.maximum(nx * light[0] + ny * light[1] + nz * light[2], 0.0)
    hv = light + np.array([0, 0, 1], F32)
    hv = hv / np.linalg.norm(hv)
    sheen = np.maximum(nx * hv[0] + ny * hv[1] + nz * hv[2], 0.0) ** 10
    noise = value_noise(rng, h, w, 6.0)
    r = np.sqrt((u - part * 0.4) ** 2 + (v + cr + 0.1) ** 2)
    k = max(8.0, round(0.55 * (1.0 / px)))
    strands = np.sin(k * np.arctan2(u - part * 0.4, v + cr + 0.1) + 2.5 * noise) * smoothstep(0.15, 0.45, r)
    if curl > 0:  # curls: two octaves of blobby noise, lit from the light's side
        cell = max(0.1, 5.0 * px)
        n1 = value_noise(rng, h, w, max(h, w) * px / cell) + 0.5 * value_noise(rng, h, w, max(h, w) * px / (0.6 * cell))
        gy, gx = np.gradient(n1, px)
        strands = 0.6 * n1 - 0.5 * (gx * light[0] + gy * light[1]) * cell
    tex = 1.0 + (0.1 + 0.06 * curl) * strands + 0.05 * noise
    base = np.array(idn.hair_colour, F32)
    luma = float(base @ np.array([0.3, 0.59, 0.11], F32))
    lit = ambient * 0.95 + (1 - ambient) * 1.1 * lam[None] * light_rgb[:, None, None]
    gloss = (0.12 + 0.25 * luma) * (0.4 if st == "crop" else 1.0)
    col = base[:, None, None] * lit * tex[None] + sheen[None] * gloss * light_rgb[:, None, None]
    col = np.clip(col, 0, 1).astype(F32)
    if st == "bald":  # a little hair on the sides only
        col = col * 0.9
    if st == "bun":  # hair wound round the bun instead of the part's radial strands
        by = top - 0.22
        rb = np.sqrt(u * u + (v - by) ** 2)
        amp = 0.12 * np.clip((0.08 / px - 3.0) / 3.0, 0.0, 1.0)
        swirl = 1.0 + amp * np.sin(3.0 * np.arctan2(v - by, u) + rb * (2 * np.pi / 0.08))
        in_bun = smoothstep(0.42, 0.3, rb)[None]
        col = col * (1 - in_bun) + np.clip(base[:, None, None] * lit * swirl[None], 0, 1) * in_bun * 1.35
    edge = 0.8 + 0.2 * smoothstep(0.0, 0.12, -cap_d)  # darker towards the outline
    front_p = (col * edge[None] * front[None]).astype(F32)
    back_p = (col * 0.68 * back[None]).astype(F32)
    return HairLayers(back_p=back_p, back_a=back.astype(F32), front_p=front_p, front_a=front.astype(F32))
