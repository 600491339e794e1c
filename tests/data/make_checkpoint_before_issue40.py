"""How tests/data/checkpoint_before_issue40/ was made: a 2-iteration LoRA train run written by the code before issue 40's
move (commit 0c45904, `flowrl_jax/train.py`, `flowrl_jax/steps.py`), kept so that a test can resume it with today's code.
Run from a checkout of that commit (`git worktree add /tmp/old 0c45904`), with the repository's venv:

    cd /tmp/old && python -c "exec(open('/path/to/tests/data/make_checkpoint_before_issue40.py').read())" OUT_DIR

It writes OUT_DIR/checkpoints/{1,2} (orbax) and OUT_DIR/params_step2.npz: the LoRA adapters at step 2 as numpy, read
back from the checkpoint by that commit's code. This file is not imported by the suite.
"""
import os
import sys

import jax
import numpy as np

from flowrl_jax import checkpoint, config_lib, main

out = sys.argv[-1]
FIELDS = {"world.base": "shapes32", "sampler.num_steps": 3, "train.iterations": 2, "train.prompts_per_iteration": 2,
          "train.group_size": 4, "train.minibatches": 2, "train.lora_rank": 2, "eval.at_start": False, "eval.every": 0,
          "checkpoint.every": 1, "diagnostics.image_change_every": 0, "sampler.sde_window": (0, 2)}
config = config_lib.load_config("configs/flow_grpo.py", **FIELDS)
main.run_job(config, out)
ckpt = checkpoint.Checkpointer(os.path.join(out, "checkpoints"))
state, _ = ckpt.restore(2, None)
ckpt.close()
flat = {"/".join(str(getattr(k, "key", k)) for k in path): np.asarray(v)
        for path, v in jax.tree_util.tree_leaves_with_path(state["params"])}
np.savez(os.path.join(out, "params_step2.npz"), **flat)
