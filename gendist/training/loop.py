"""The training loop: batches, steps, validation, metrics, checkpoints, resume."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import sys
import time
from pathlib import Path

import jax
import numpy as np

from gendist import supervise
from gendist.config import Config, ModelConfig, check_pipeline
from gendist.data.batches import TextData, process_rows, shard_batch
from gendist.output import console, report, rundir
from gendist.sharding import make_mesh
from gendist.training.checkpoint import Checkpointer
from gendist.training.train import NonFiniteLoss, Setup, build, host_metrics, throughput


class MetricsWriter:
    """Metrics to a JSONL file and (optionally) TensorBoard; only process 0 writes."""

    def __init__(self, out_dir: Path, tensorboard: bool, wandb: str = "off",
                 wandb_project: str = "gendist", cfg: Config | None = None, start: int = 0):
        """Appends to out_dir/metrics.jsonl after dropping its records of steps after
        `start` (a resumed run's rows written after its checkpoint, or a fresh run's)."""
        self.active = jax.process_index() == 0
        self.tb = self.wandb = None
        if not self.active:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        rundir.drop_records_after(out_dir / "metrics.jsonl", start)
        if wandb != "off":
            from gendist.output.wandb_logger import WandbLogger
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
    history: list[dict]  # per step: {"step" (from 0), "loss", ...}; a finished run: logged ones
    val_loss: float | None  # the last validation loss
    setup: Setup


class Preempted(KeyboardInterrupt):
    """The run stopped on SIGINT or SIGTERM after checkpointing the step it reached (a
    KeyboardInterrupt, so code that handles Ctrl-C handles it)."""

    def __init__(self, signum: int, step: int, end: int, directory: Path):
        self.signum, self.step, self.directory = signum, step, directory
        self.exit_code = 128 + signum  # 130 for SIGINT, 143 for SIGTERM
        super().__init__(
            f"stopped by {signal.Signals(signum).name} at step {step} of {end}; checkpoint "
            f"of step {step} saved in {directory}; run the same command again to resume.")


def evaluate(setup: Setup, data: TextData, params) -> float:
    """The mean validation loss over train.eval_batches batches; `params` as `eval_fn` takes
    them (`setup.eval_params(state)`)."""
    t = setup.cfg.train
    losses = []
    rows_n = batch_rows(setup.cfg)
    rows = process_rows(setup.mesh, rows_n)
    for i in range(t.eval_batches):
        batch = data.global_batch(i, t.batch_size, t.seq_len, "val", rows)
        losses.append(setup.eval_fn(params, shard_batch(batch, setup.mesh, rows_n)))
    return float(np.mean(jax.device_get(losses)))


STEP_TIMEOUT_ENV = "GENDIST_STEP_TIMEOUT"
ADAPTERS_DIR = "adapters"  # a LoRA run's adapters, saved alone at its end (lora.save)


def batch_rows(cfg: Config) -> int:
    """Rows of a global batch: train.batch_size sequences, or 2 per preference pair (DPO)."""
    return cfg.train.batch_size * (2 if cfg.train.objective == "dpo" else 1)


def load_data(cfg: Config):
    """The run's data: text windows, or preference pairs for train.objective=dpo."""
    if cfg.train.objective == "dpo":
        from gendist.data.preferences import PreferenceData
        return PreferenceData.from_config(cfg.data)
    return TextData.from_config(cfg.data)


def check_vocab(model: ModelConfig, data) -> None:
    """Every token id of the data must be below model.vocab_size (else NaN at step 0)."""
    if hasattr(data, "check_vocab"):  # gendist.data.batches.TextData: text or token files
        data.check_vocab(model.vocab_size)
        return
    top = int(max(data.train.max(initial=0), data.val.max(initial=0)))
    if top >= model.vocab_size:
        raise ValueError(
            f"model.vocab_size={model.vocab_size} is too small for the data, whose largest "
            f"token id is {top}; pass --model.vocab-size {max(top + 1, 256)} or more.")


def run(cfg: Config, mesh=None, data: TextData | None = None, stop_after: int | None = None,
        log=None, step_timeout: float | None = None, init_params=None) -> RunResult:
    """Train `cfg.train.steps` steps (resuming from out_dir's latest checkpoint).

    Prints a header (model, mesh, batch per device, output paths), validation losses and a
    footer through `log` (default: `console.say`, process 0 only, above the progress bar).
    Refuses, before any step, a data set with token ids >= model.vocab_size, an out_dir
    whose checkpoint was written by another config or is past train.steps
    (`gendist.output.rundir`); a refused run takes back the directories and files it made.
    SIGINT or SIGTERM during training checkpoints the step reached, agreed by every
    process, and raises `Preempted` (a second signal exits at once: `StopRequest`).
    `stop_after` ends the loop early at that step (after checkpointing it), as if the
    process had been killed there: used by the exact-resume test. `step_timeout` (or
    $GENDIST_STEP_TIMEOUT) seconds without a finished step, eval or checkpoint after the
    first step end the process with a message instead of a hang (see supervise.Watchdog).
    `init_params` starts a fresh run from given weights instead of a random init (fine-tuning;
    a resumed run ignores it): a params dict, or a function of the params' shardings that
    returns one placed on them (e.g. `hf.load_params` onto a ZeRO-3 mesh).
    """
    footprint = rundir.Footprint(Path(cfg.train.out_dir))
    try:
        return _run(cfg, mesh, data, stop_after, log, step_timeout, init_params, footprint)
    except BaseException:
        footprint.undo()  # only before the first step: after it, footprint.keep() was called
        raise


def _run(cfg: Config, mesh, data: TextData | None, stop_after: int | None, log,
         step_timeout: float | None, init_params, footprint: rundir.Footprint) -> RunResult:
    t0 = time.perf_counter()
    log = console.say if log is None else log
    t = cfg.train
    data = load_data(cfg) if data is None else data
    check_vocab(cfg.model, data)
    if hasattr(data, "check_windows"):  # TextData: a window fits each split
        data.check_windows(t.seq_len)
    if mesh is None:  # a mesh axis of -1 is only known now
        mesh = make_mesh(cfg.mesh)
    if mesh.shape["pipeline"] > 1:
        check_pipeline(cfg.model, mesh.shape["pipeline"], cfg.train.pipeline_stage_layers,
                       cfg.train.pipeline_chunks)
    setup = build(cfg, mesh)  # checks the config against the mesh; compiles nothing yet
    out = Path(t.out_dir)
    # One Checkpointer, before the resume check: creating one is a barrier of all processes,
    # so every process must create the same ones whatever the file system shows it.
    ckpt = Checkpointer(out / "checkpoints", keep=t.keep_checkpoints)
    try:
        saved = _saved_run(cfg, ckpt, out)
    except BaseException:
        ckpt.close()
        raise
    state, meta = None, {}
    if saved is not None:
        state, meta, _ = ckpt.restore(setup.abstract_state(), saved)
        log(f"resumed from {ckpt.directory} step {saved} (val_loss {meta.get('val_loss')})")
    if state is None:
        state = setup.init_state(params=init_params)
    start = int(jax.device_get(state["step"]))
    if jax.process_index() == 0:
        from gendist import config_yaml
        config_yaml.save(cfg, out / config_yaml.YAML_NAME)  # --config accepts it back
    writer = MetricsWriter(out, t.tensorboard, t.wandb, t.wandb_project, cfg, start)
    rows_n = batch_rows(cfg)
    rows = process_rows(setup.mesh, rows_n)
    end = max(start, t.steps if stop_after is None else min(t.steps, stop_after))
    history: list[dict] = []
    val_loss = None
    for line in report.header(cfg, setup.mesh, start, end, out):
        log(line)
    if start >= end:
        log(f"WARNING: {out} is already at step {start} of train.steps={t.steps}: nothing to "
            f"train. Raise --train.steps to continue it, or start a new run with "
            f"--train.out-dir {rundir.fresh_dir(t.out_dir)}.")
        history = [{**r, "step": r["step"] - 1}  # as a trained step's entry: from 0
                   for r in rundir.read_records(out / "metrics.jsonl")
                   if "loss" in r and r["step"] <= start]
        val_loss = meta.get("val_loss")
    bar = console.Progress(range(start, end), t.progress)
    pending = None  # (step, metrics) dispatched but not yet pulled to the host
    t_last, tokens_since = time.perf_counter(), 0

    def drain(pending):
        nonlocal t_last, tokens_since
        step_no, metrics = pending
        m = host_metrics(metrics)
        m["finite"] = bool(m["finite"])
        tokens_since += rows_n * t.seq_len  # counted when done, not when dispatched
        history.append({"step": step_no, **m})
        if not m["finite"]:
            msg = f"step {step_no}: non-finite loss {m['loss']} / grad norm {m.get('grad_norm')}"
            if t.matmul_precision == "fp8" and math.isfinite(m["loss"]):
                msg += " (an FP8 product's amax overflowed)"
            if t.nonfinite == "stop":
                raise NonFiniteLoss(msg + "; the step was not applied and no checkpoint was "
                                    "written. Lower train.lr or set --train.nonfinite skip.")
            log(msg + "; step skipped (train.nonfinite=skip)")
        if (step_no + 1) % t.log_every == 0 or step_no + 1 == end:
            now = time.perf_counter()
            m.update(throughput(cfg, tokens_since, now - t_last))
            t_last, tokens_since = now, 0
            writer.write(step_no + 1, m)
            bar.set_postfix(loss=f"{m['loss']:.3f}")
            if bar.step_lines:
                log(f"step {step_no + 1}/{end}: loss {m['loss']:.4f}, "
                    f"{m['tokens_per_s']:,.0f} tokens/s")

    if step_timeout is None and os.environ.get(STEP_TIMEOUT_ENV):
        step_timeout = float(os.environ[STEP_TIMEOUT_ENV])
    dog = supervise.Watchdog(step_timeout) if step_timeout else contextlib.nullcontext()
    beat = dog.beat if step_timeout else (lambda label: None)
    agree = supervise.Agreement(start)
    every_s = t.checkpoint_every_minutes * 60
    stopped = 0  # the signal the run stopped on
    try:
        with dog, supervise.StopRequest() as stop:
            stop.saved = _last_checkpoint(ckpt.latest_step(), ckpt.directory)
            last_save = time.monotonic()
            for step_no in bar:
                batch = shard_batch(data.global_batch(step_no, t.batch_size, t.seq_len,
                                                      "train", rows), setup.mesh, rows_n)
                state, metrics = setup.step_fn(state, batch)
                footprint.keep()  # a step ran: the run directory is no longer ours to undo
                if pending is not None:
                    drain(pending)
                    beat(f"step {pending[0] + 1}")
                pending = (step_no, metrics)
                done = step_no + 1
                signum, timed = agree.decide(
                    done, stop.signum, bool(every_s) and time.monotonic() - last_save >= every_s)
                stopping = signum and done < end
                if done % t.eval_every == 0 or done == end:
                    drain(pending)
                    pending = None
                    val_loss = evaluate(setup, data, setup.eval_params(state))
                    writer.write(done, {"val_loss": val_loss})
                    log(f"step {done}: val_loss {report.val_text(cfg, val_loss)}")
                    beat(f"step {done} and its validation")
                if ((t.checkpoint_every and done % t.checkpoint_every == 0) or done == end
                        or timed or stopping):
                    if pending is not None:  # never checkpoint before seeing it was finite
                        drain(pending)
                        pending = None
                    ckpt.save(done, state, {"val_loss": val_loss, "config": _cfg_json(cfg)})
                    last_save = time.monotonic()
                    stop.saved = _last_checkpoint(done, ckpt.directory)
                    beat(f"checkpoint {done}")
                if stopping:
                    stopped = signum
                    break
            if pending is not None:
                drain(pending)
            if val_loss is None and not stopped:  # no validation loss saved: compute one
                val_loss = evaluate(setup, data, setup.eval_params(state))
            saved_step = ckpt.latest_step()
            if "base" in state and not stopped:  # LoRA: the adapters alone, beside the run
                from gendist.training import lora
                params = state["params"]
                if jax.process_count() > 1:
                    from jax.experimental import multihost_utils
                    params = multihost_utils.process_allgather(params, tiled=True)
                if jax.process_index() == 0:
                    lora.save(out / ADAPTERS_DIR, cfg.model, cfg.train, params)
    except Exception as e:
        if jax.process_count() > 1 and supervise.is_runtime_error(e):
            print(supervise.lost_peer_message(e, ckpt.latest_step(), ckpt.directory),
                  file=sys.stderr, flush=True)
        raise
    finally:
        bar.close()
        writer.close()
        ckpt.close()
    if stopped:
        raise Preempted(stopped, saved_step, t.steps, ckpt.directory)
    for line in report.footer(cfg, start, end, time.perf_counter() - t0, history, val_loss,
                              saved_step, out):
        log(line)
    return RunResult(state, history, val_loss, setup)


def _last_checkpoint(step: int | None, directory: Path) -> str:
    if step is None:
        return "no checkpoint yet"
    return f"the last complete checkpoint is step {step} in {directory}"


def _saved_run(cfg: Config, ckpt: Checkpointer, out: Path) -> int | None:
    """The step to resume from (None: a fresh run), after checking that `cfg` may continue
    the run in `out` (`rundir.check_resume`); reads only the metadata, changes nothing."""
    step = ckpt.latest_step()
    if step is None:
        return None
    rundir.check_resume(cfg, ckpt.read_meta(step).get("config"), step, out)
    return step


def _cfg_json(cfg: Config) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(cfg), default=str))
