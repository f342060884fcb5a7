"""PNG checks and tiny TensorBoard event files the curve tests share."""
from __future__ import annotations

import struct
from pathlib import Path

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path) -> tuple[int, int]:
    """(width, height) of the PNG at ``path``, after PIL has verified the whole file (every
    chunk's CRC, the image data decompresses); AssertionError if it is not a PNG."""
    from PIL import Image

    data = Path(path).read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR", f"{path} is not a PNG"
    with Image.open(path) as im:
        im.verify()
    return struct.unpack(">II", data[16:24])


def write_events(tb_dir, scalars: dict[str, dict[int, float]]) -> None:
    """Write ``tag → {step: value}`` as one TensorBoard event file in ``tb_dir``, as
    rtd_scale's TensorBoardLogger does (torch.utils.tensorboard.SummaryWriter)."""
    from torch.utils.tensorboard import SummaryWriter

    w = SummaryWriter(str(tb_dir))
    try:
        for tag, points in scalars.items():
            for step, value in sorted(points.items()):
                w.add_scalar(tag, value, step)
    finally:
        w.close()


def synthetic_scalars() -> dict[str, dict[int, float]]:
    """Every tag the curves draw, at iterations 1, 5 and 10 (validation at 5 and 10)."""
    train = (1, 5, 10)
    return {
        "loss/mlm": dict(zip(train, (7.0, 6.5, 6.0))),
        "valid/loss/mlm": {5: 6.6, 10: 6.1},
        "loss/rtd": dict(zip(train, (0.69, 0.45, 0.40))),
        "valid/loss/rtd": {5: 0.46, 10: 0.41},
        "rtd/replaced_fraction": dict(zip(train, (0.15, 0.15, 0.15))),
        "valid/rtd/replaced_fraction": {5: 0.15, 10: 0.15},
        "valid/rtd/auc": {5: 0.55, 10: 0.62},
        "embedding/avg_cosine_generator": dict(zip(train, (0.0, 0.2, 0.4))),
        "embedding/avg_cosine_discriminator": dict(zip(train, (0.0, 0.1, 0.3))),
        "optim/lr": dict(zip(train, (0.0, 1e-3, 5e-4))),
        "throughput/tokens_per_s": dict(zip(train, (1000.0, 2000.0, 2100.0))),
    }
