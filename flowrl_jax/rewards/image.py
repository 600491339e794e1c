"""Rewards of any image, needing no model: DDPO's JPEG (in)compressibility (Black et al. 2023, §6.1).

    r = jpeg_compressibility(images, prompts)      # images [B, H, W, 3] in [-1, 1] -> -kilobytes [B]

The image is quantized to 8 bits and saved as JPEG at quality 95 (DDPO's setting); the reward is minus
(compressibility) or plus (incompressibility) its size in kB. Prompt-independent: a world-agnostic reward
for the latent world's smoke runs and a baseline any image pipeline can learn.
"""
from __future__ import annotations

import io

import numpy as np
from PIL import Image


def to_uint8(images) -> np.ndarray:
    """[..., 3] in [-1, 1] -> uint8 (round half to even), as every image reward and the reward service quantize."""
    return np.clip(np.round((np.asarray(images, np.float32) + 1.0) * 127.5), 0, 255).astype(np.uint8)


def jpeg_kilobytes(images: np.ndarray, quality: int = 95) -> np.ndarray:
    """[B, H, W, 3] in [-1, 1] -> [B] float32: the JPEG file size in kB (1 kB = 1000 bytes)."""
    pixels = to_uint8(images)
    sizes = []
    for image in pixels:
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, format="JPEG", quality=quality)
        sizes.append(buffer.tell() / 1000.0)
    return np.asarray(sizes, np.float32)


def jpeg_compressibility(images, prompts) -> np.ndarray:
    return -jpeg_kilobytes(images)


def jpeg_incompressibility(images, prompts) -> np.ndarray:
    return jpeg_kilobytes(images)
