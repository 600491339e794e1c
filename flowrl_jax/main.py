"""Entry point: `python -m flowrl_jax.main --config configs/<name>.py[:variant] [--config.a.b=v] [--workdir d]`.

Dispatches on `config.job` to `<module>.run(config, workdir)`. Config mistakes (an unknown key, a
missing required field, an unknown job) end the run with one line naming the key (exit 2). A reward server
that fails ends it with one line naming the server and the checkpoint saved: exit 75 (EX_TEMPFAIL: rerun later) when it
was unreachable or busy past the deadline or slow, 2 when the request or the server needs fixing first. A train run
stopped by a signal or a preemption notice saves and exits 75 too: the same command resumes it. Exit 0 is a run that
ended (its last iteration, or its time budget): a supervisor (`tpu_scripts/supervise.sh`, a JobSet's restarts) restarts
on 75 and on a crash, never on 0 or 2.
"""
from __future__ import annotations

import importlib
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from flowrl_jax import compiler, parallel
from flowrl_jax.config_lib import ConfigError, require
from flowrl_jax.rewards.remote import RewardServerError

# job name -> (module with run(config, workdir), fields it requires)
JOBS = {
    "inspect": ("flowrl_jax.jobs.inspect", ("model", "mesh", "seed", "inspect.batch_size", "inspect.text_len")),
    "pretrain": ("flowrl_jax.jobs.pretrain", ("model", "text", "mesh", "seed", "pretrain.steps", "pretrain.batch_size")),
    "train_reward": ("flowrl_jax.jobs.train_reward", ("seed", "reward.base", "reward.steps")),
    "export_asset": ("flowrl_jax.jobs.export_asset", ("seed", "export.workdir", "export.name")),
    "train": ("flowrl_jax.jobs.train", ("seed", "world.name", "sampler.kind", "train.iterations", "objective.name")),
    "eval_base": ("flowrl_jax.jobs.eval_base", ("seed", "eval.checkpoint", "eval.split", "eval.num_steps")),
    # after training: a train config (the run's) with --config.job=<one of these> and the run's --workdir (rl/trained.py)
    "sample": ("flowrl_jax.jobs.sample", ("seed", "world.name", "policy.step", "sample.num_steps", "eval.num_steps")),
    "evaluate": ("flowrl_jax.jobs.evaluate", ("seed", "world.name", "policy.step", "eval.num_steps", "eval.samples_per_prompt")),
    "export": ("flowrl_jax.jobs.export", ("seed", "world.name", "policy.step", "export.formats", "train.lora_rank")),
}

_CONFIG = config_flags.DEFINE_config_file("config", None, "Python config file (get_config), optionally :variant.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and samples.")


EXIT_RERUN_LATER = 75  # sysexits.h EX_TEMPFAIL: stopped by a signal, or a reward server was down; the same command resumes


def _fail(message: str, code: int = 2) -> None:
    print(f"flowrl_jax: error: {message}", file=sys.stderr)
    sys.exit(code)


def _unknown_override(argv, missing: str) -> str | None:
    """The `--config.a.b=v` argument whose path contains the segment the config lacks."""
    for arg in argv:
        if arg.startswith("--config."):
            path = arg[len("--config."):].split("=", 1)[0]
            if missing in path.split("."):
                return path
    return None


def parse_flags(argv):
    """absl flag parsing with one-line errors for config mistakes."""
    try:
        args = flags.FLAGS(argv)
        if flags.FLAGS.config is not None:
            flags.FLAGS.config.keys()  # a config file that failed to load raises here
        return args
    except OSError as e:  # ml_collections defers "no such config file" to the first access
        _fail("cannot load --config: " + str(e).strip().splitlines()[-1].strip())
    except AttributeError as e:  # ml_collections: an override of a key the (locked) config lacks
        missing = str(e).strip("\"'")
        key = _unknown_override(argv, missing) or missing
        _fail(f"unknown config key {key!r}: the config has no field {missing!r} (check the spelling against the config file)")
    except (flags.Error, KeyError, TypeError, ValueError) as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        # A config file that raised: keep the flag and the exception's last line, not the traceback.
        _fail(lines[0].split(":")[0] + ": " + lines[-1] if "Traceback" in str(e) else " ".join(lines))


def job_module(config):
    """The module of `config.job` once the config has the fields that job requires (ConfigError otherwise)."""
    job = config.get("job")
    if not job:
        raise ConfigError("config has no field 'job'; set config.job to one of " + ", ".join(sorted(JOBS)))
    if job not in JOBS:
        raise ConfigError(f"unknown job {job!r} (config.job); known jobs: {', '.join(sorted(JOBS))}")
    module, required = JOBS[job]
    require(config, required)
    return importlib.import_module(module)


def validate(config) -> None:
    """Every check of `config` that needs no model or data: its job's fields and the job's own `validate`."""
    module = job_module(config)
    if hasattr(module, "validate"):
        module.validate(config)


def run_job(config, workdir: str | None):
    """Check `config` for its job, run it and return what it returns."""
    return job_module(config).run(config, workdir)


def main(argv) -> None:
    if len(argv) > 1:
        _fail(f"unexpected arguments {argv[1:]}; flags look like --config=configs/x.py --config.a.b=value")
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # orbax and jax log every step at INFO; -v 0 brings it back
    if _CONFIG.value is None:
        _fail("--config is required, e.g. --config configs/inspect_mmdit.py")
    config = _CONFIG.value
    try:
        try:  # before any job touches JAX
            parallel.maybe_initialize_distributed(config.get("distributed", "auto"),
                                                  config.get("distributed_timeout_s", parallel.DISTRIBUTED_TIMEOUT_S))
        except ValueError as e:  # a config.distributed that is no switch
            raise ConfigError(str(e)) from None
        except parallel.DistributedStartError as e:
            _fail(str(e))
        compiler.use_persistent_cache(config.get("compilation_cache", "auto"), _WORKDIR.value)
        result = run_job(config, _WORKDIR.value)
    except ConfigError as e:
        _fail(str(e))
    except RewardServerError as e:
        _fail(str(e), EXIT_RERUN_LATER if e.retryable else 2)
    if isinstance(result, dict) and result.get("resumable"):  # a train run stopped before its end, its checkpoint saved
        sys.exit(EXIT_RERUN_LATER)


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
