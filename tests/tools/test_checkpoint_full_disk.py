"""A real full disk (a 256 KiB tmpfs mounted with ``mount``) under ``torch_save``
(training/checkpoint/files.py): the OSError (ENOSPC) is kept, where torch's own writer says only
"unexpected pos"."""
from __future__ import annotations

import pytest
import torch

from rtd_scale.training.checkpoint.files import safe_load, torch_save


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 256 KiB tmpfs (a real full disk), or a skip where mounting is not permitted."""
    import subprocess

    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=True)


def test_a_full_disk_during_torch_save_is_enospc(small_tmpfs):
    """torch's own writer turns ENOSPC into "unexpected pos …"; torch_save keeps the
    OSError, so the save can say what happened."""
    import errno

    with pytest.raises(RuntimeError, match="unexpected pos"):
        torch.save({"w": torch.zeros(200_000)}, small_tmpfs / "plain.pt")
    (small_tmpfs / "plain.pt").unlink()
    with pytest.raises(OSError) as e:
        torch_save({"w": torch.zeros(200_000)}, str(small_tmpfs / "a.pt"))
    assert e.value.errno == errno.ENOSPC
    (small_tmpfs / "a.pt").unlink()
    torch_save({"w": torch.arange(4.0)}, str(small_tmpfs / "b.pt"))
    assert torch.equal(safe_load(str(small_tmpfs / "b.pt"))["w"], torch.arange(4.0))
