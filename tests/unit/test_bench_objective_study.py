"""bench/objective_study.py: each run is the main job's command with its objective's flags, the
MLM run gets the steps whose FLOPs equal the RTD run's, it saves at the points it fine-tunes,
and the table says how far apart the objectives are in seeds' standard deviations."""
from __future__ import annotations

import argparse
import re

from tests.helpers.env import REPO

from bench import objective_study as study


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"ranks": 2, "master_port": 29573, "points": 3, **kw})


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_a_run_is_the_main_jobs_command_with_its_objectives_flags():
    script = (REPO / "tools" / "run_default.sh").read_text()
    flags = study.objective_flags("modernbert-tiny", "mlm")
    assert flags == ("--preset", "modernbert-tiny", "--set", "rtd.objective=mlm",
                     "--mask-prob", "0.3")
    assert study.objective_flags("debertav3-tiny", "rtd") == ("--preset", "debertav3-tiny")
    assert _flag(list(study.objective_flags("debertav3-tiny", "mlm")), "--mask-prob") == "0.15"
    cmd = study.command(_args(), flags, 600, 7, "s.model", "p", REPO / "r")
    assert _flag(cmd, "--ds_config") == re.search(r"RTD_DS_CONFIG:-([^}]+)}", script)[1]
    assert _flag(cmd, "--num_gpus") == re.search(r"RTD_RANKS:-(\d+)", script)[1]
    assert _flag(cmd, "--eval-iters") == re.search(r"--eval-iters (\d+)", script)[1]
    assert (_flag(cmd, "--train-iters"), _flag(cmd, "--seed")) == ("600", "7")
    assert _flag(cmd, "--save-interval") == "200" and cmd[-len(flags):] == list(flags)
    # 3 points of 700 steps: 233, 467, 700 — saved at every step they share
    assert study.save_points(700, 3) == [233, 467, 700]
    assert _flag(study.command(_args(), (), 700, 7, "s", "p", REPO / "r"),
                 "--save-interval") == "1"
    assert study.save_points(5, 1) == [5] and study.save_points(2, 3) == [1, 2]


def test_a_run_keeps_only_its_points(tmp_path):
    """Saving every step to reach 307, 613 and 920 filled the disk (14 MB a step × 920 per MLM
    run): after each run only the points' checkpoints stay."""
    run = tmp_path / "run"
    for step in range(1, 8):
        (run / f"global_step{step}").mkdir(parents=True)
        (run / f"global_step{step}" / "mp_rank_00_model_states.pt").write_bytes(b"x")
    (run / "latest").write_text("global_step7")
    assert study.prune(run, [3, 7]) == [f"global_step{s}" for s in (1, 2, 4, 5, 6)]
    assert sorted(p.name for p in run.iterdir()) == ["global_step3", "global_step7", "latest"]
    assert study.prune(run, [3, 7]) == []


def test_the_mlm_run_gets_the_rtd_runs_flops_per_preset():
    """rtd_scale/flops.py at the presets' 32 × 128 tokens a step: debertav3-tiny's RTD step
    (generator of half the depth + discriminator, mask 0.25) costs 1.53 of its masked LM's
    (the discriminator's encoder, mask 0.15); modernbert-tiny's 1.13."""
    rtd, tokens = study.step_flops("debertav3-tiny", "rtd")
    mlm, same = study.step_flops("debertav3-tiny", "mlm")
    assert tokens == same == 32 * 128
    assert (round(rtd), round(mlm)) == (7_850_304, 5_118_566)
    assert study.matched_steps(600, rtd, mlm) == 920
    rtd, _ = study.step_flops("modernbert-tiny", "rtd")
    mlm, _ = study.step_flops("modernbert-tiny", "mlm")
    assert study.matched_steps(600, rtd, mlm) == 679


def test_the_mlm_run_gets_the_rtd_runs_flops():
    # the generator (half the depth) + discriminator against the discriminator alone
    assert study.matched_steps(600, 3.0e6, 2.0e6) == 900
    assert study.matched_steps(600, 1.0, 7.0) == 86  # rounded
    assert study.matched_steps(1, 1.0, 7.0) == 1


def test_the_table_gives_each_point_and_the_gap_in_pooled_sds():
    def row(obj, point, steps, genre, pos):
        return {"arch": "debertav3-tiny", "objective": obj, "point": point, "steps": steps,
                "flops": 2.5e12 * point, "scores": {"brown-genre": genre, "brown-pos": pos}}

    rows = [row("rtd", 1, 300, [0.20, 0.22, 0.24], [0.50, 0.52, 0.54]),
            row("rtd", 2, 600, [0.30, 0.32, 0.34], [0.60, 0.62, 0.64]),
            row("mlm", 1, 450, [0.18, 0.20, 0.22], [0.50, 0.50, 0.50]),
            row("mlm", 2, 900, [0.26, 0.28, 0.30], [0.61, 0.62, 0.63])]
    lines = study.table(rows, ("brown-genre", "brown-pos")).splitlines()
    assert lines[0] == ("| architecture | objective | point | steps | pretraining PFLOPs | seeds | "
                        "brown-genre accuracy | brown-pos accuracy |")
    assert lines[3] == ("| debertav3-tiny | RTD | 2 | 600 | 0.005 | 3 | 0.320 ± 0.020 | "
                        "0.620 ± 0.020 |")
    # genre: (0.32 − 0.28) / 0.02 = 2.0 sds; POS: 0 / √((0.02² + 0.01²)/2) = 0
    assert lines[-2:] == ["- debertav3-tiny, brown-genre: RTD − MLM = +0.040 (+2.0 pooled sds "
                          "over 3 seeds)",
                          "- debertav3-tiny, brown-pos: RTD − MLM = +0.000 (+0.0 pooled sds "
                          "over 3 seeds)"]
    assert study.pooled_sds([0.1], [0.2]) is None and study.pooled_sds([1, 1], [1, 1]) is None


def test_the_figure_is_drawn(tmp_path):
    rows = [{"arch": "modernbert-tiny", "objective": o, "point": 1, "steps": 10, "flops": 1e12,
             "scores": {"brown-pos": [0.5, 0.6]}} for o in ("rtd", "mlm")]
    study.figure(rows, ("brown-pos",), tmp_path / "f.png")
    assert (tmp_path / "f.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_work_dir_that_is_a_file_is_one_line(tmp_path, capsys):
    import pytest

    (tmp_path / "f").write_text("")
    with pytest.raises(SystemExit) as e:
        study.parse_args(["--work-dir", str(tmp_path / "f")])
    assert e.value.code == 2
    assert capsys.readouterr().err.startswith(
        f"error: --work-dir {tmp_path / 'f'}: exists and is not a directory; pass a directory")
