"""The training loop's phases on their own: build, step, save and restore, the bookkeeping
after a step. The whole loop is tested in test_train.py; these pin each piece."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest
import torch

from anyorder import checkpoint as ck
from anyorder.errors import TrainingError
from anyorder.training.bookkeeping import LoopState, check_finite, fit_and_estimate
from anyorder.training.distributed import DistEnv
from anyorder.training.metrics import MetricsLog
from anyorder.training.setup import build_parts, prepare_data, resolve_vocab
from anyorder.training.state import lr_at, restore_state, save_state, snapshot
from anyorder.training.step import train_step
from anyorder.training.validation import count_evaluations
from test_train import _cfg


def _parts(tmp_path, **extra):
    """The parts of a tiny aogpt run in one process (data prepared once per test)."""
    cfg = _cfg(tmp_path / "run", tmp_path / "cache", "aogpt", **extra)
    env = DistEnv()
    data = prepare_data(cfg, env, dry_run=False, progress=False, tmp=None)
    return build_parts(resolve_vocab(cfg, data.tokenizer.vocab_size), env, data, None)


def _loop(parts, step: int, **extra) -> LoopState:
    return LoopState(
        run_dir=Path(parts.cfg.train.out_dir),
        log=MetricsLog(None, False, None),
        step=step,
        tokens_seen=0,
        start_step=0,
        last_ckpt=None,
        unigram=None,
        to_bpb=1.0,
        t0=time.perf_counter(),
        loop_t0=time.perf_counter(),
        **extra,
    )


def test_step_save_restore_step_is_two_steps_straight(tmp_path) -> None:
    """train_step twice == train_step, save_state, restore_state into fresh parts (whose
    generators and cursor were moved on), train_step: the same losses and bits."""
    straight = _parts(tmp_path)
    losses = [train_step(straight, 0), train_step(straight, 1)]

    first = _parts(tmp_path)
    loss0 = train_step(first, 0)
    path = save_state(first, tmp_path / "run", 1, tokens_seen=256)
    assert path is not None and path.name == "step_0000001"
    again = _parts(tmp_path)
    torch.manual_seed(99)  # what restore must put back: torch's RNG, the order generator,
    again.order_gen.manual_seed(99)  # the data cursor
    for _ in range(3):
        again.sampler.next_indices()
    assert restore_state(again, path) == (1, 256)
    assert [loss0, train_step(again, 1)] == losses
    for name, value in straight.model.state_dict().items():
        torch.testing.assert_close(again.model.state_dict()[name], value, atol=0, rtol=0)
    for a, b in zip(straight.ema.shadow, again.ema.shadow):
        torch.testing.assert_close(b, a, atol=0, rtol=0)


def test_a_nonfinite_loss_stops_with_the_state_before_it_or_is_skipped(tmp_path) -> None:
    parts = _parts(tmp_path)
    loop = _loop(parts, 3, loss=float("nan"))
    before = snapshot(parts)
    parts.sampler.next_indices()  # the failed step moved the cursor on
    with pytest.raises(TrainingError) as err:
        check_finite(parts, loop, before)
    saved = tmp_path / "run" / ck.CHECKPOINTS / "step_0000003"
    assert str(err.value) == (
        f"loss is nan at step 4; the state after step 3 is in {saved}; lower train.lr and "
        "resume with --resume, or set train.skip_nonfinite=true to skip such steps"
    )
    assert ck.read_state(saved)["sampler"] == before["sampler"]  # not the moved cursor

    skip = dataclasses.replace(parts.cfg.train, skip_nonfinite=True)
    parts.cfg = dataclasses.replace(parts.cfg, train=skip)
    check_finite(parts, loop, None)
    assert loop.skipped == 1
    loop.loss = 2.5
    check_finite(parts, loop, None)  # a finite loss: nothing to do
    assert loop.skipped == 1


def test_a_time_limit_fits_the_horizon_and_the_schedule_ends_there(tmp_path, capsys) -> None:
    parts = _parts(
        tmp_path, **{"train.steps": 100, "train.eval_every": 5, "train.min_lr_ratio": 0.1}
    )
    # 4 steps in 2.5 s (the first, 1 s, left out): 0.5 s a step. 0.9 of the 5.83 s left fits
    # 10.5 more steps, so train.steps becomes 4 + 10.
    loop = _loop(parts, 4, time_limit_s=2.5 + 10.5 * 0.5 / 0.9, end=100, timing=[1, 0.5, 0.5, 0.5])
    loop.loop_t0 = time.perf_counter() - 2.5
    capsys.readouterr()  # the set-up's lines (where the data is prepared)
    fit_and_estimate(parts, loop)
    assert parts.cfg.train.steps == loop.end == 14
    lr = parts.cfg.train.lr  # the cosine now ends at step 14, not 100
    assert lr_at(13, parts.cfg) < 0.12 * lr and lr_at(14, parts.cfg) == pytest.approx(0.1 * lr)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"time limit {loop.time_limit_s:.0f} s: train.steps set to 14"
    assert out[1].startswith("train: 10 more steps and 3 validation(s): about ")


def test_count_evaluations_matches_the_loops_condition() -> None:
    """Validation comes every ``every`` steps and at the end (the loop's condition)."""
    for every in range(5):
        for step in range(10):
            for end in range(step + 1, 16):
                want = sum(
                    1 for s in range(step + 1, end + 1) if (every and s % every == 0) or s == end
                )
                assert count_evaluations(step, end, every) == want, (step, end, every)
