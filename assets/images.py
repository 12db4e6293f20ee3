"""Images drawn offline for the image pipelines, tests and benchmark: shapes on colours.

Deterministic (a seed per image), in mixed sizes and formats, so a shard of them exercises
decoding (PNG, JPEG, WebP; wide, tall, small, large) the way a real collection does.
Pillow only; nothing is downloaded.
"""

from __future__ import annotations

import io
import random
import struct
import zlib

from PIL import Image, ImageDraw

SHAPES = ("circle", "square", "triangle", "stripes")
COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (40, 70, 220),
    "yellow": (230, 210, 40),
    "purple": (140, 50, 170),
}
# (width, height) a generated shard mixes: small, square, wide, tall, large.
MIXED_SIZES = ((48, 48), (64, 64), (160, 120), (120, 320), (640, 480), (1024, 768))


def draw_shape(shape: str, colour: str, size: tuple[int, int], *, seed: int = 0) -> Image.Image:
    """A `shape` in `colour` on a seeded pale background, `size` (width, height)."""
    rng = random.Random(seed)
    width, height = size
    background = tuple(rng.randrange(200, 256) for _ in range(3))
    image = Image.new("RGB", size, background)  # type: ignore[arg-type]
    draw = ImageDraw.Draw(image)
    fill = COLOURS[colour]
    x0, y0 = rng.randrange(0, max(width // 4, 1)), rng.randrange(0, max(height // 4, 1))
    x1, y1 = (
        width - 1 - rng.randrange(0, max(width // 4, 1)),
        height - 1 - rng.randrange(0, max(height // 4, 1)),
    )
    if shape == "circle":
        draw.ellipse((x0, y0, x1, y1), fill=fill)
    elif shape == "square":
        draw.rectangle((x0, y0, x1, y1), fill=fill)
    elif shape == "triangle":
        draw.polygon([(x0, y1), ((x0 + x1) // 2, y0), (x1, y1)], fill=fill)
    else:
        step = max(width // 8, 2)
        for x in range(0, width, step * 2):
            draw.rectangle((x, 0, x + step - 1, height), fill=fill)
    return image


def encode(image: Image.Image, image_format: str = "PNG", **options: object) -> bytes:
    """`image` encoded as `image_format` (PNG, JPEG, WEBP, ...)."""
    buffer = io.BytesIO()
    image.save(buffer, format=image_format, **options)
    return buffer.getvalue()


def bomb_png(width: int = 100_000, height: int = 100_000) -> bytes:
    """A PNG whose header claims `width` x `height` pixels and holds none: a decompression
    bomb's shape (the bad-image tests' and the zoo's)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    return (
        b"\x89PNG\r\n\x1a\n"
        + struct.pack(">I", len(ihdr))
        + chunk
        + struct.pack(">I", zlib.crc32(chunk))
        + b"\0\0\0\0IEND\xaeB`\x82"
    )


def shape_rows(count: int, *, seed: int = 0, sizes: tuple[tuple[int, int], ...] = MIXED_SIZES):
    """`count` rows `(id, caption, encoded image bytes)`: seeded shapes in mixed sizes and
    formats; the caption names the shape and colour ("a red circle")."""
    rng = random.Random(seed)
    formats = ("PNG", "JPEG", "WEBP")
    rows = []
    for i in range(count):
        shape, colour = rng.choice(SHAPES), rng.choice(sorted(COLOURS))
        size = sizes[i % len(sizes)]
        image = draw_shape(shape, colour, size, seed=seed * 100_003 + i)
        image_format = formats[i % len(formats)]
        data = encode(image, image_format, **({"quality": 90} if image_format != "PNG" else {}))
        rows.append((f"img-{seed}-{i:05d}", f"a {colour} {shape}", data))
    return rows
