"""The training loop: batches, steps, validation, metrics, checkpoints, resume."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

import jax
import numpy as np

from gendist.checkpoint import Checkpointer
from gendist.config import Config
from gendist.data import TextData, process_rows, shard_batch
from gendist.distributed import Watchdog, is_runtime_error, lost_peer_message
from gendist.train import NonFiniteLoss, Setup, build, host_metrics, throughput


class MetricsWriter:
    """Metrics to a JSONL file and (optionally) TensorBoard; only process 0 writes."""

    def __init__(self, out_dir: Path, tensorboard: bool, wandb: str = "off",
                 wandb_project: str = "gendist", cfg: Config | None = None):
        self.active = jax.process_index() == 0
        self.tb = self.wandb = None
        if not self.active:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        if wandb != "off":
            from gendist.wandb_logger import WandbLogger
            self.wandb = WandbLogger(out_dir, cfg, wandb, wandb_project)
        self.jsonl = open(out_dir / "metrics.jsonl", "a")  # noqa: SIM115
        if tensorboard:
            try:
                from tensorboardX import SummaryWriter
                self.tb = SummaryWriter(str(out_dir / "tb"))
            except ImportError:
                self.tb = None

    def write(self, step: int, metrics: dict) -> None:
        if not self.active:
            return
        self.jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
        self.jsonl.flush()
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.write(step, metrics)

    def close(self):
        if self.active:
            self.jsonl.close()
            if self.tb is not None:
                self.tb.close()
            if self.wandb is not None:
                self.wandb.close()


@dataclasses.dataclass
class RunResult:
    state: dict
    history: list[dict]  # one entry per step: {"step", "loss", ...}
    val_loss: float | None
    setup: Setup


def evaluate(setup: Setup, data: TextData, params) -> float:
    t = setup.cfg.train
    losses = []
    rows = process_rows(setup.mesh, t.batch_size)
    for i in range(t.eval_batches):
        batch = data.global_batch(i, t.batch_size, t.seq_len, "val", rows)
        losses.append(setup.eval_fn(params, shard_batch(batch, setup.mesh, t.batch_size)))
    return float(np.mean(jax.device_get(losses)))


STEP_TIMEOUT_ENV = "GENDIST_STEP_TIMEOUT"


def run(cfg: Config, mesh=None, data: TextData | None = None, stop_after: int | None = None,
        log=print, step_timeout: float | None = None, init_params=None) -> RunResult:
    """Train `cfg.train.steps` steps (resuming from out_dir's latest checkpoint).

    `stop_after` ends the loop early at that step (after checkpointing it), as if the
    process had been killed there: used by the exact-resume test. `step_timeout` (or
    $GENDIST_STEP_TIMEOUT) seconds without a finished step, eval or checkpoint after the
    first step end the process with a message instead of a hang (see distributed.Watchdog).
    `init_params` starts a fresh run from given weights instead of a random init (fine-tuning;
    a resumed run ignores it): a params dict, or a function of the params' shardings that
    returns one placed on them (e.g. `hf.load_params` onto a ZeRO-3 mesh).
    """
    t = cfg.train
    setup = build(cfg, mesh)
    data = TextData.from_config(cfg.data) if data is None else data
    if hasattr(data, "check_vocab"):  # a token id >= vocab_size would be NaN at step 0
        data.check_vocab(cfg.model.vocab_size)
    out = Path(t.out_dir)
    ckpt = Checkpointer(out / "checkpoints", keep=t.keep_checkpoints)
    state = None
    if not t.resume and ckpt.latest_step() is not None:
        raise ValueError(
            f"train.resume=False but {ckpt.directory} already holds checkpoints (latest step "
            f"{ckpt.latest_step()}); choose a fresh train.out_dir, delete that folder, or "
            "resume from it with train.resume=True.")
    if t.resume and ckpt.latest_step() is not None:
        state, meta, at = ckpt.restore(setup.abstract_state())
        log(f"resumed from {ckpt.directory} step {at} (val_loss {meta.get('val_loss')})")
    if state is None and init_params is not None:
        state = setup.init_state(params=init_params)
    if state is None:
        state = setup.init_state()
    start = int(jax.device_get(state["step"]))
    if jax.process_index() == 0:
        from gendist import config_yaml
        config_yaml.save(cfg, out / config_yaml.YAML_NAME)  # --config accepts it back
    writer = MetricsWriter(out, t.tensorboard, t.wandb, t.wandb_project, cfg)
    rows = process_rows(setup.mesh, t.batch_size)
    unit = "byte" if getattr(data, "tokenizer", "bytes") == "bytes" else "token"
    end = t.steps if stop_after is None else min(t.steps, stop_after)
    history: list[dict] = []
    val_loss = None
    bar = _progress(range(start, end), t.progress and jax.process_index() == 0)
    pending = None  # (step, metrics) dispatched but not yet pulled to the host
    t_last, tokens_since = time.perf_counter(), 0

    def drain(pending):
        nonlocal t_last, tokens_since
        step_no, metrics = pending
        m = host_metrics(metrics)
        m["finite"] = bool(m["finite"])
        tokens_since += t.batch_size * t.seq_len  # counted when done, not when dispatched
        history.append({"step": step_no, **m})
        if not m["finite"]:
            msg = f"step {step_no}: non-finite loss {m['loss']} / grad norm {m.get('grad_norm')}"
            if t.nonfinite == "stop":
                raise NonFiniteLoss(msg + "; the step was not applied and no checkpoint was "
                                    "written. Lower train.lr or set --train.nonfinite skip.")
            log(msg + "; step skipped (train.nonfinite=skip)")
        if (step_no + 1) % t.log_every == 0 or step_no + 1 == end:
            now = time.perf_counter()
            m.update(throughput(cfg, tokens_since, now - t_last))
            t_last, tokens_since = now, 0
            writer.write(step_no + 1, m)
            bar.set_postfix(loss=f"{m['loss']:.3f}", refresh=False)

    if step_timeout is None and os.environ.get(STEP_TIMEOUT_ENV):
        step_timeout = float(os.environ[STEP_TIMEOUT_ENV])
    dog = Watchdog(step_timeout) if step_timeout else contextlib.nullcontext()
    beat = dog.beat if step_timeout else (lambda label: None)
    try:
        with dog:
            for step_no in bar:
                batch = shard_batch(data.global_batch(step_no, t.batch_size, t.seq_len,
                                                      "train", rows), setup.mesh, t.batch_size)
                state, metrics = setup.step_fn(state, batch)
                if pending is not None:
                    drain(pending)
                    beat(f"step {pending[0] + 1}")
                pending = (step_no, metrics)
                done = step_no + 1
                if done % t.eval_every == 0 or done == end:
                    drain(pending)
                    pending = None
                    val_loss = evaluate(setup, data, state["params"])
                    writer.write(done, {"val_loss": val_loss})
                    log(f"step {done}: val_loss {val_loss:.4f} nats/{unit}")
                    beat(f"step {done} and its validation")
                if (t.checkpoint_every and done % t.checkpoint_every == 0) or done == end:
                    if pending is not None:  # never checkpoint before seeing it was finite
                        drain(pending)
                        pending = None
                    ckpt.save(done, state, {"val_loss": val_loss, "config": _cfg_json(cfg)})
                    beat(f"checkpoint {done}")
            if pending is not None:
                drain(pending)
            if val_loss is None:  # nothing left to train (resumed at the end): still report
                val_loss = evaluate(setup, data, state["params"])
    except Exception as e:
        if jax.process_count() > 1 and is_runtime_error(e):
            print(lost_peer_message(e, ckpt.latest_step(), ckpt.directory), file=sys.stderr,
                  flush=True)
        raise
    finally:
        writer.close()
        ckpt.close()
    return RunResult(state, history, val_loss, setup)


def _cfg_json(cfg: Config) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(cfg), default=str))


def _progress(it, enabled: bool):
    if enabled:
        from tqdm.auto import tqdm
        return tqdm(it, desc="train", dynamic_ncols=True)

    class _Quiet:
        def __init__(self, it):
            self.it = it

        def __iter__(self):
            return iter(self.it)

        def set_postfix(self, **_):
            return None

    return _Quiet(it)
